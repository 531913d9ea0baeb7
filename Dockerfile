# syntax=docker/dockerfile:1
# cuserve: OpenAI-compatible LLM server.
#   GPU (default):  docker build -t cuserve .
#   CPU only:       docker build --build-arg VARIANT=cpu -t cuserve:cpu .
#   Run:            docker run --gpus all -p 8000:8000 -v cuserve-cache:/home/cuserve/.cache/cuserve cuserve
#                   (flags after the image name go to `cuserve serve`, e.g. --model /models/m.gguf)
ARG VARIANT=cuda

FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04 AS base-cuda
# NVRTC compiles the kernels at start: it needs the CUDA headers (cuda_fp16.h, cuda_bf16.h),
# which the runtime image leaves out; gcc compiles the CPU kernels of the fallback runner.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv gcc libgomp1 curl ca-certificates \
        cuda-cudart-dev-13-0 \
 && rm -rf /var/lib/apt/lists/*
ENV CUSERVE_EXTRAS=cuda13

FROM python:3.12-slim-bookworm AS base-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libgomp1 curl ca-certificates \
 && rm -rf /var/lib/apt/lists/*
ENV CUSERVE_EXTRAS=

FROM base-${VARIANT}
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin cuserve && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
WORKDIR /opt/cuserve
COPY pyproject.toml README.md config.yaml ./
COPY engine ./engine
COPY server ./server
COPY kernels_cuda ./kernels_cuda
COPY tools/install.sh ./tools/install.sh
# the same install script CI runs (tools/install.sh), with the CUDA extra on GPU images
RUN bash tools/install.sh ${CUSERVE_EXTRAS}

USER cuserve
ENV CUSERVE_HOST=0.0.0.0 CUSERVE_PORT=8000 CUSERVE_CACHE=/home/cuserve/.cache/cuserve
RUN mkdir -p /home/cuserve/.cache/cuserve
VOLUME ["/home/cuserve/.cache/cuserve"]
EXPOSE 8000
# the first start may download the default model (98 MB) and compile kernels
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD curl -fsS "http://127.0.0.1:${CUSERVE_PORT}/health" || exit 1
ENTRYPOINT ["cuserve", "serve", "--config", "/opt/cuserve/config.yaml"]
CMD []
