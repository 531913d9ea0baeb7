"""Every .cu family (and the benchmarks' .cu files) compiles with nvcc for sm_90 and, in fp16,
sm_80 (the float8 variants for sm_90 alone), in fp16 and bf16 (no GPU needed).

CI machines have nvcc but no GPU: this catches a kernel that does not build before a
GPU run would. The constants are those of common models (head_dim 64/128, GQA groups).
Device code alone is built (-fatbin: the runtime compiles the sources with NVRTC, so the
host stubs nvcc -c would also compile are never used), and the bf16 variants differ from
the fp16 ones in the 16-bit type only, so they are built for sm_90 alone: the suite's
longest test took 316 s on the 2-core CI machine, half the suite.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels_cuda"
BENCH = KERNELS.parent / "bench"
NVCC = shutil.which("nvcc")
ARCHS = ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90")
FP8_ARCHS = ("-gencode", "arch=compute_90,code=sm_90")  # the e4m3 conversions need sm_89+; and bf16 variants
# per family, the -D constant sets it is built with at run time (a representative few)
VARIANTS = {"flash_decode": [{"HEAD_DIM": 64, "GROUP": 3}, {"HEAD_DIM": 128, "GROUP": 4},
                             {"HEAD_DIM": 128, "GROUP": 4, "BUFS": 2, "AHEAD": 2},  # decode graphs' (PDL) forms
                             {"HEAD_DIM": 64, "GROUP": 3, "BUFS": 4, "AHEAD": 4},
                             {"HEAD_DIM": 64, "GROUP": 3, "TG": 4, "BUFS": 8, "AHEAD": 8},  # tile groups
                             {"HEAD_DIM": 128, "GROUP": 16, "TG": 4, "BUFS": 4, "AHEAD": 4},
                             {"HEAD_DIM": 64, "GROUP": 3, "TG": 4, "BUFS": 8, "AHEAD": 8, "STAMPS": 2},  # --points
                             {"HEAD_DIM": 64, "GROUP": 3, "TG": 4, "BUFS": 8, "AHEAD": 8, "EARLY_TRIGGER": 1},
                             {"HEAD_DIM": 128, "GROUP": 4, "KV_FP8": 1, "SWAP": 1, "MIN_BLOCKS": 4, "QK_WGMMA": 1,
                              "BUFS": 4, "AHEAD": 4, "STAMPS": 2},
                             {"HEAD_DIM": 128, "GROUP": 4, "KV_FP8": 1, "WHOLE": 256},
                             {"HEAD_DIM": 128, "GROUP": 4, "KV_FP8": 1, "SWAP": 1, "MIN_BLOCKS": 4},
                             {"HEAD_DIM": 128, "GROUP": 4, "KV_FP8": 1, "SWAP": 1, "MIN_BLOCKS": 4, "QK_WGMMA": 1,
                              "BUFS": 4, "AHEAD": 4},
                             {"HEAD_DIM": 128, "GROUP": 4, "KV_FP8": 1, "SWAP": 1, "MIN_BLOCKS": 4, "QK_WGMMA": 1,
                              "BUFS": 3, "AHEAD": 3},
                             {"HEAD_DIM": 128, "GROUP": 16, "KV_FP8": 1}],
            "flash_prefill": [{"HEAD_DIM": 64}, {"HEAD_DIM": 128}, {"HEAD_DIM": 128, "KV_FP8": 1},
                              {"HEAD_DIM": 128, "KV_FP8": 1, "HEADS": 2}, {"HEAD_DIM": 64, "HEADS": 4}],
            "rope": [{"HEAD_DIM": 64}, {"HEAD_DIM": 128}, {"HEAD_DIM": 64, "KV_FP8": 1}, {"HEAD_DIM": 128, "PROD": 1},
                     {"HEAD_DIM": 128, "PROD": 2, "KV_FP8": 1}, {"HEAD_DIM": 36, "PROD": 2, "KV_FP8": 1},
                     {"HEAD_DIM": 128, "PROD": 2, "KV_FP8": 1, "ROPE_ITEMS": 2}, {"HEAD_DIM": 64, "ROPE_ITEMS": 1}],
            "activation": [{}, {"PROD": 1}, {"PROD": 2}, {"PROD": 2, "QUANT_OUT": 1, "SILU_VEC": 7},  # common.cuh
                           {"PROD": 2, "QUANT_OUT": 1, "SILU_VEC": 4, "SILU_STAGES": 2},
                           {"PROD": 1, "SILU_VEC": 5, "SILU_STAGES": 3}],
            "rmsnorm": [{}, {"QUANT_OUT": 1}, {"QUANT_OUT": 1, "NORM_VEC": 8}, {"QUANT_OUT": 1, "NORM_AHEAD": 1},
                        {"PROD": 1}, {"PROD": 2, "QUANT_OUT": 1, "NORM_AHEAD": 1},
                        {"PROD": 2, "QUANT_OUT": 1, "NORM_AHEAD": 1, "RES16": 1}, {"RES16": 1},
                        {"ROW_THREADS": 128, "HIDDEN": 4096, "RES16": 1, "PROD": 2, "QUANT_OUT": 1, "ROW_SCALED": 1},
                        {"ROW_THREADS": 32, "HIDDEN": 256, "RES16": 1, "ROW_BIAS": 1},
                        {"ROW_THREADS": 128, "HIDDEN": 4096, "RES16": 1, "QUANT_OUT": 1, "ROW_DELTA": 0}],
            "quant": [{}, {"Q_ROW_THREADS": 128, "Q_K": 4096}, {"Q_ROW_THREADS": 32, "Q_K": 256}],
            "embedding": [{}, {"RES16": 1}, {"EARLY_TRIGGER": 1}],  # small models' decode graphs
            "rescore": [{}, {"CAND": 1}, {"CAND": 32}],
            "gemv": [{}, {"HEAD_DIM": 64, "KV_FP8": 1}, {"DEPTH": 4}, {"W_FP8": 1}, {"W_FP8": 1, "DEPTH": 4},
                     {"PRELOAD": 1}, {"PRELOAD": 1, "W_FP8": 1}, {"NORM_IN": 1, "HEAD_DIM": 64},
                     {"NORM_IN": 1, "W_FP8": 1, "PRELOAD": 1}, {"STAGED": 1, "DEPTH": 4, "MIN_BLOCKS": 4},
                     {"STAGED": 1, "DEPTH": 8, "STAGES": 1, "HEAD_DIM": 64, "KV_FP8": 1},
                     {"W_Q8": 1}, {"W_Q8": 1, "PRELOAD": 1, "DEPTH": 4, "TILE_LOOP": 1},
                     {"PRELOAD": 1, "TILE_LOOP": 1, "HEAD_DIM": 64}],
            "attn_block": [{"HEAD_DIM": 64, "GROUP": 3, "HIDDEN": 576}, {"HEAD_DIM": 64, "GROUP": 2, "HIDDEN": 128,
                                                                          "KV_FP8": 1},
                           {"HEAD_DIM": 16, "GROUP": 3, "HIDDEN": 96}],
            "attn_o": [{"HEAD_DIM": 64, "GROUP": 3, "HIDDEN": 576}, {"HEAD_DIM": 64, "GROUP": 2, "HIDDEN": 128,
                                                                      "KV_FP8": 1},
                       {"HEAD_DIM": 16, "GROUP": 3, "HIDDEN": 96}],
            "mlp_block": [{"HIDDEN": 576, "QW": 576, "INTER": 1536}, {"HIDDEN": 128, "QW": 192, "INTER": 256}],
            "read_patterns": [{"PATTERN": 0, "DEPTH": 8}, {"PATTERN": 3, "DEPTH": 4}, {"PATTERN": 3, "DEPTH": 8}],
            "flash_prefill_wgmma": [{"HEAD_DIM": 128, "HEADS": 2, "KV_FP8": 1}, {"HEAD_DIM": 128, "HEADS": 2},
                                    {"HEAD_DIM": 64, "HEADS": 1, "KV_FP8": 1}, {"HEAD_DIM": 64, "HEADS": 3, "RAW": 4}],
            "gemm_fp8": [{"BT": 32, "CW": 1, "KBOX": 2, "MIN_BLOCKS": 2, "SPLITS": 3},
                         {"BT": 128, "RM": 2, "CW": 2}, {"BT": 256, "SPLITS": 2, "OUT_F32": 1},
                         {"BT": 64, "RM": 7, "CW": 2, "TSPLIT": 2, "STAGES": 3}]}
FP8_ONLY = {"quant"}  # families that are all e4m3
# families built for an architecture-specific target at run time (gemm.py: wgmma needs sm_90a);
# built for it here too, so that the wgmma and tensor-copy code is compiled, not #if-ed away; and
# the variants of other families that take wgmma (flash_decode.py's QK_WGMMA)
SM90A = ("-gencode", "arch=compute_90a,code=sm_90a")
ARCH_SPECIFIC = {family: SM90A for family in ("gemm_fp8", "flash_prefill_wgmma")}


def jobs():
    for cu in sorted(KERNELS.glob("*.cu")) + sorted(BENCH.glob("*.cu")):
        for defines in VARIANTS.get(cu.stem, [{}]):
            for bf16 in (0, 1) if cu.parent == KERNELS else (0,):  # the benchmarks' files hold no 16-bit type
                yield cu, {**defines, "USE_BF16": bf16}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_every_kernel_family_compiles(tmp_path):
    def build(job):
        cu, defines = job
        flags = [f"-D{k}={v}" for k, v in defines.items()]
        out = tmp_path / f"{cu.stem}-{'-'.join(map(str, defines.values()))}.fatbin"
        fp8 = defines.get("KV_FP8") or defines.get("W_FP8") or defines.get("QUANT_OUT") or cu.stem in FP8_ONLY
        sm90_only = fp8 or defines["USE_BF16"]
        archs = (ARCH_SPECIFIC.get(cu.stem) or (SM90A if defines.get("QK_WGMMA") else None)
                 or (FP8_ARCHS if sm90_only else ARCHS))
        result = subprocess.run([NVCC, "-std=c++17", f"-I{KERNELS}", *flags, *archs, "-fatbin", str(cu), "-o",
                                 str(out)], capture_output=True, text=True)
        return cu.name, defines, result.returncode, result.stderr[-2000:]

    all_jobs = list(jobs())
    assert {cu.stem for cu, _ in all_jobs} >= {"embedding", "rmsnorm", "rope", "activation", "gemv",
                                               "flash_decode", "flash_prefill", "sampling", "read_patterns",
                                               "attn_block", "attn_o", "mlp_block", "gemm_fp8",
                                               "flash_prefill_wgmma"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [r for r in pool.map(build, all_jobs) if r[2] != 0]
    assert not failures, "\n".join(f"{name} {defines}:\n{err}" for name, defines, _, err in failures)


# Llama-3-8B's 16-bit QKV product at 1-8 rows (gemv.py: CONFIG, one tile, rows past the first pass so
# PRELOAD 0; not staged): 6,144 rows in blocks of 8 rows and 256 threads, 768 blocks. On an H200's 132
# SMs they take one wave only at 6 blocks an SM, so at most 40 registers a thread. 54 (0a9054d, the
# epilogue's Pre held in registers) made it two waves: 14.7 -> 20.6 us a layer, B=1 240.7 -> 230.6
# tok/s (docs/performance.md, sixtieth session).
QKV_8B = {"WARPS": 8, "DEPTH": 8, "PRELOAD": 0, "HEAD_DIM": 128}
QKV_8B_BLOCKS, H200_SMS = 6144 // 8, 132


def sm90_blocks_an_sm(regs: int, threads: int, smem: int) -> int:
    """Blocks of `threads` threads, `regs` registers each and `smem` bytes of shared memory that fit
    one sm_90 SM: 64 K registers (allocated per warp in units of 256, i.e. 8 a thread), 2,048
    threads, 228 KB of shared memory with 1 KB reserved a block."""
    by_regs = (64 << 10) // (-(-regs // 8) * 8 * threads)
    return min(by_regs, 2048 // threads, (228 << 10) // (smem + 1024))


def test_sm90_blocks_an_sm():
    assert sm90_blocks_an_sm(40, 256, 4096) == 6
    assert sm90_blocks_an_sm(41, 256, 4096) == 5  # 48 allocated
    assert sm90_blocks_an_sm(54, 256, 4096) == 4
    assert sm90_blocks_an_sm(32, 256, 100 << 10) == 2  # shared memory bound


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("variant", [{"USE_BF16": 0, "KV_FP8": 0}, {"USE_BF16": 1, "KV_FP8": 1}])
def test_the_8b_qkv_product_fits_one_wave(variant):
    flags = [f"-D{k}={v}" for k, v in {**QKV_8B, **variant}.items()]
    result = subprocess.run([NVCC, "-std=c++17", f"-I{KERNELS}", *flags, "-arch=sm_90", "-cubin", "-o", "/dev/null",
                             str(KERNELS / "gemv.cu"), "-Xptxas", "-v"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    report = result.stderr.split("Compiling entry function 'gemv_rope_8' for 'sm_90'")[1].split("Compiling")[0]
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    smem = int(re.search(r"(\d+) bytes smem", report).group(1))
    blocks = sm90_blocks_an_sm(regs, QKV_8B["WARPS"] * 32, smem)
    assert blocks * H200_SMS >= QKV_8B_BLOCKS, (
        f"gemv_rope_8 takes {regs} registers and {smem} bytes of shared memory: {blocks} blocks an SM, "
        f"so the 8B QKV product's {QKV_8B_BLOCKS} blocks need more than one wave")
