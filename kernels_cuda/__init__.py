"""CUDA kernels launched through CuPy RawModule: one family per .cu file, each with a
Python wrapper of the same name (shape/dtype checks, grid, launch on the current stream)."""
