#!/usr/bin/env bash
# GPU checks on a lent device machine (the device tool runs this in the repo root).
#   stage 1: install the carried wheels (.whl/), keep part 1 of SmolLM2 (.devpart/) in /tmp/cuserve_store,
#            kernel tests (KTESTS: a -k filter) and the tiny-model runner tests (RTESTS: their -k filter);
#            FP8=1: the fp8 matrix products and decode graphs; MIXED=1: a mixed step by kernel; GRAPHS=1: decode graph timings; SWEEP=1: those,
#            the skinny-GEMM sweep, prefill attention alone and TTFT; PROFILE=1: per-kernel times (ncu)
#   stage 2: assemble SmolLM2 from the stored and carried parts; runner, engine and server tests on the GPU
#            and the SmolLM2 decode benchmark (TESTS=0 skips these); FULL_BENCH=1, LOAD=1: the benchmarks;
#            SERVE=1: only FULL_BENCH's serving part; SERVE_TARGET=1: issue 6's serving target over HTTP (fp8, the
#            default budget, bfloat16), the default LM head against --quantize-lm-head, LOADS (2) loads each
# Logs go to $OUT (the tool brings them back); a summary table is printed last.
# Wheels the lent machines lack (cp312, manylinux x86_64; match the versions in your venv): fastapi,
#   starlette, pydantic, pydantic_core, typing_extensions, typing_inspection, annotated_types, annotated_doc,
#   anyio, sniffio, idna, uvicorn, click, h11, uvloop, httptools, gguf, opentelemetry_api (fastapi >= 0.16x);
#   for the openai client test: openai, jiter, distro, httpx, httpcore, certifi, and for openai 3.x httpx2,
#   httpcore2, truststore.
set -uo pipefail
stage=${1:?stage 1 or 2}
store=/tmp/cuserve_store  # outside the repo copy, which every call re-syncs
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD CUSERVE_CACHE=$store/cache TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" $store/cache/models
summary=()
run() {  # run NAME CMD... : log to $OUT/NAME.log, remember the last line
    local name=$1; shift
    local start=$SECONDS
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    summary+=("$(printf '%-22s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
}

if [ "$stage" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; exit 1; }
    mv .devpart/smollm2.part00 $store/ 2>/dev/null || true
    nvidia-smi -L > "$OUT/env.log" 2>&1
    python3 -c "import cupy, numpy, sys; print(sys.version); print('cupy', cupy.__version__, 'numpy', numpy.__version__); \
print(cupy.cuda.runtime.getDeviceProperties(0)['name'])" >> "$OUT/env.log" 2>&1
    for f in kernels_cuda/*.cu; do
        nvcc -arch=sm_90 -std=c++17 -Ikernels_cuda -DHEAD_DIM=128 -DGROUP=4 -c "$f" -o /tmp/k.o -Xptxas -v 2>&1 \
            | grep -E "error|Compiling entry|registers|spill" ; done > "$OUT/ptxas.log" 2>&1
    # in KJOBS processes where pytest-xdist is there (the device image has it): the whole file no longer fits
    # one call serially (~80 % in 560 s, fifty-fifth session), and its time is mostly NVRTC compiles (CPU)
    jobs=()
    python3 -c "import xdist" 2>/dev/null && jobs=(-n "${KJOBS:-4}")
    run kernels timeout 560 python3 -m pytest -q -rf ${jobs[@]+"${jobs[@]}"} tests/test_kernels_gpu.py ${KTESTS:+-k "$KTESTS"}
    run runner_tiny timeout 170 python3 -m pytest -q -rf -s tests/test_cuda_runner.py -k "${RTESTS:-tiny or long_context}"
    if [ "${FP8:-0}" = 1 ]; then  # --quantization fp8: its matrix products alone, then the decode graphs
        run fp8_matmuls timeout 300 python3 bench/kernels.py --shape llama3-8b --fp8 --batch 1,16,32,64,128,256,2048
        run graph_8b_w8 timeout 300 python3 bench/kernels.py --shape llama3-8b --batch 1,16,64,128 --skip-matmul \
            --quantization fp8
        grep -h "^fp8" "$OUT"/fp8_matmuls.log | cut -c1-200
        grep -h "graph" "$OUT"/graph_8b_w8.log | sed 's/ (.*execute/ execute/'
    fi
    if [ "${SWEEP:-0}" = 1 ]; then  # skinny-GEMM shapes, prefill attention alone, TTFT
        run sweep_8b timeout 300 python3 bench/kernels.py --shape llama3-8b --batch 1,8,16 --gemv-sweep \
            --attention 512,2048,8192
        run prefill_8b timeout 200 python3 bench/prefill.py --model random:llama3-8b --json "$OUT/prefill_8b.json"
        grep -hE "attention|step matmuls" "$OUT"/sweep_8b.log | cut -c1-72
        tail -n 9 "$OUT/prefill_8b.log"
    fi
    if [ "${MIXED:-0}" = 1 ]; then  # a serving step (252 decodes + 4 prompts of 448) by kernel, fp8 + fp8 K/V
        run mixed_8b timeout 300 python3 bench/kernels.py --shape llama3-8b --mixed 252,576,4,448 \
            --quantization fp8 --kv-cache-dtype fp8
        cat "$OUT/mixed_8b.log" | grep -v Loading | head -n 20
    fi
    if [ "${SWEEP:-0}" = 1 ] || [ "${GRAPHS:-0}" = 1 ]; then  # decode graphs alone (PDL on and off)
        run graph_8b timeout 300 python3 bench/kernels.py --shape llama3-8b --batch 1,8,16,64,128 --skip-matmul
        run graph_smollm2 timeout 200 python3 bench/kernels.py --shape smollm2-135m --batch 1,8,64 --skip-matmul
        grep -h "graph" "$OUT"/graph_*.log | sed 's/ (.*execute/ execute/'
    fi
    if [ "${PROFILE:-0}" = 1 ]; then  # per-kernel times of one decode graph (ncu, kernels one at a time)
        for spec in llama3-8b:1 llama3-8b:128 smollm2-135m:1; do
            shape=${spec%%:*}; b=${spec#*:}
            timeout 300 ncu --profile-from-start off --graph-profiling node --csv --print-units base \
                --metrics gpu__time_duration.sum,dram__bytes_read.sum \
                python3 bench/kernels.py --shape "$shape" --batch "$b" --profile > "$OUT/ncu_${shape}_$b.csv" 2>&1
            echo "== $shape B=$b"
            python3 bench/kernels.py --ncu-summary "$OUT/ncu_${shape}_$b.csv" 2>&1 | head -n 16
        done
    fi
else
    model=$store/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
    if [ "${TESTS:-1}" = 1 ] || [ "${LOAD:-0}" = 1 ]; then  # the parts that run SmolLM2
        if [ ! -f $store/smollm2.part00 ]; then echo "part 1 missing: the machine went cold; run stage 1 again"; exit 3; fi
        cat $store/smollm2.part00 .devpart/smollm2.part01 .devpart/smollm2.part02 > "$model"
        echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $model" | sha256sum -c \
            > "$OUT/model.log" 2>&1 || { echo "model checksum failed"; exit 4; }
    fi
    if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: only the FULL_BENCH / LOAD parts
        # 400 s: on a machine whose kernel cache is cold (stage 1 ran no runner test) the file's first
        # NVRTC builds take ~200 s of it; warm, it runs in ~50 s
        run runner timeout 400 python3 -m pytest -q -rf -s tests/test_cuda_runner.py
        run server_gpu env CUSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -rf tests/test_server.py
        run bench_smollm2 timeout 150 python3 bench/decode.py --model "$model" --device cuda --batch 1,8,64,128 \
            --prompt-len 32 --max-tokens 128 --json "$OUT/decode_smollm2.json"
    fi
    if [ "${FULL_BENCH:-0}" = 1 ]; then
        run bench_8b timeout 300 python3 bench/decode.py --model random:llama3-8b --device cuda --batch 1,32,64,128 \
            --prompt-len 512 --max-tokens 128 --kv-cache-gib 24 --json "$OUT/decode_8b.json"
        run bench_8b_kv8 timeout 300 python3 bench/decode.py --model random:llama3-8b --device cuda \
            --batch 1,32,64,128 --prompt-len 512 --max-tokens 128 --kv-cache-gib 24 --kv-cache-dtype fp8 \
            --json "$OUT/decode_8b_kv8.json"
        run bench_8b_w8 timeout 300 python3 bench/decode.py --model random:llama3-8b --device cuda \
            --batch 1,32,64,128 --prompt-len 512 --max-tokens 128 --kv-cache-gib 24 --kv-cache-dtype fp8 \
            --quantization fp8 --json "$OUT/decode_8b_w8.json"
        run prefill_8b timeout 200 python3 bench/prefill.py --model random:llama3-8b --json "$OUT/prefill_8b.json"
        run prefill_8b_w8 timeout 200 python3 bench/prefill.py --model random:llama3-8b --quantization fp8 \
            --json "$OUT/prefill_8b_w8.json"
        run peer_hf timeout 400 python3 bench/peer_hf.py --shape llama3-8b --batch 1,32,128 --json "$OUT/peer_hf.json"
    fi
    if [ "${FULL_BENCH:-0}" = 1 ] || [ "${SERVE:-0}" = 1 ]; then  # serving: engine alone, then over HTTP
        for variant in 16 w8; do  # 16-bit weights and K/V; then --quantization fp8 --kv-cache-dtype fp8
            extra=(); sfx=""
            [ $variant = w8 ] && { extra=(--quantization fp8 --kv-cache-dtype fp8); sfx=_w8; }
            # the same load on the engine alone, every step traced (where serving time goes)
            run serve_8b${sfx}_engine timeout 240 python3 bench/serve.py --engine random:llama3-8b --device cuda \
                "${extra[@]}" --max-num-batched-tokens 8192 --kv-cache-gib 40 --num-prompts 1024 --input-len 512 \
                --output-len 128 --concurrency 256 --vocab 120000 --json "$OUT/serve_8b${sfx}_engine.json"
            python3 -m server.cli serve --model random:llama3-8b --port 8011 --max-num-seqs 256 "${extra[@]}" \
                --max-num-batched-tokens 8192 --kv-cache-gib 40 --max-model-len 2048 \
                > "$OUT/serve_8b${sfx}_server.log" 2>&1 &
            srv=$!
            for i in $(seq 1 180); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done
            run serve_8b${sfx}_c256 timeout 240 python3 bench/serve.py --url http://127.0.0.1:8011 --num-prompts 1024 \
                --input-len 512 --output-len 128 --concurrency 256 --vocab 120000 --json "$OUT/serve_8b${sfx}_c256.json"
            run serve_8b${sfx}_c1 timeout 120 python3 bench/serve.py --url http://127.0.0.1:8011 --num-prompts 6 \
                --input-len 512 --output-len 128 --concurrency 1 --vocab 120000 --json "$OUT/serve_8b${sfx}_c1.json"
            curl -s localhost:8011/metrics | grep -E "roofline|num_requests|kv_cache_usage" \
                > "$OUT/serve${sfx}_metrics.log"
            kill $srv; wait $srv 2>/dev/null
        done
    fi
    if [ "${SERVE_TARGET:-0}" = 1 ]; then  # issue 6's serving target: each server in turn, compared at the end
        flags="--model random:llama3-8b --max-num-seqs 256 --quantization fp8 --kv-cache-dtype fp8 --dtype bfloat16"
        flags="$flags --kv-cache-gib 40 --max-model-len 2048"
        run serve_target timeout 560 python3 bench/serve.py --serve "$flags" --serve "$flags --quantize-lm-head" \
            --loads "${LOADS:-2}" --num-prompts 1024 --input-len 512 --output-len 128 --concurrency 256 \
            --vocab 120000 --goal 12000,150 --serve-log "$OUT/serve_target_server.log" --json "$OUT/serve_target.json"
        grep -A8 "servers compared" "$OUT/serve_target.log"
    fi
    if [ "${LOAD:-0}" = 1 ]; then  # issue 8's load test (500 requests, 64 concurrent, 10 % dropped) on the GPU
        for spec in "smollm2:$model" "llama3-8b:random:llama3-8b"; do
            name=${spec%%:*}; target=${spec#*:}
            python3 -m server.cli serve --model "$target" --port 8012 --max-num-seqs 64 --kv-cache-gib 8 \
                --max-model-len 1024 > "$OUT/load_${name}_server.log" 2>&1 &
            srv=$!
            for i in $(seq 1 180); do curl -sf localhost:8012/health > /dev/null && break; sleep 1; done
            run "load_$name" timeout 240 python3 bench/load_test.py --url http://127.0.0.1:8012 --requests 500 \
                --concurrency 64 --cancel 0.1 --max-tokens 16 --json "$OUT/load_$name.json"
            kill $srv; wait $srv 2>/dev/null
        done
    fi
    tail -n 6 "$OUT"/bench_*.log "$OUT"/prefill_8b*.log "$OUT"/peer_hf.log "$OUT"/serve_8b*_c*.log 2>/dev/null
    tail -n 5 "$OUT"/serve_8b*_engine.log 2>/dev/null
    tail -n 22 "$OUT"/load_*.log 2>/dev/null | grep -vE "^\s*$"
fi
echo
echo "== stage $stage summary =="
printf '%s\n' "${summary[@]}"
