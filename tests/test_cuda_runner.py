"""The CUDA runner against the NumPy runner, and through the engine (GPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from engine import Engine, EngineConfig, SamplingParams, SchedulerConfig  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.outputs import ScheduledSeq, SchedulerOutput  # noqa: E402
from engine.runner.numpy_runner import NumpyRunner  # noqa: E402
from tests.runner_helpers import REGION, decode_step, prefill_step  # noqa: E402
from tests.tiny_models import VOCAB, build_tiny_model  # noqa: E402

DATA = json.loads((Path(__file__).parent / "data" / "llamacpp_smollm2.json").read_text(encoding="utf-8"))


def cuda_runner(model, max_model_len=2048, max_num_seqs=16, eager=False, kv_bytes=1 << 30, kv_dtype="auto",
                quantization=None, fp8_accumulation="fast", budget=2048, dtype="auto", quantize_lm_head=False):
    from engine.runner.cuda_runner import CudaRunner
    config = EngineConfig(model="test", device="cuda", enforce_eager=eager, quantization=quantization,
                          fp8_accumulation=fp8_accumulation, dtype=dtype, quantize_lm_head=quantize_lm_head,
                          cache=CacheConfig(kv_cache_bytes=kv_bytes, kv_cache_dtype=kv_dtype),
                          scheduler=SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max(budget, max_num_seqs)))
    return CudaRunner(config, model, progress=False)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.fixture(scope="module")
def smollm2_gpu(smollm2):
    return cuda_runner(smollm2)


def teacher_forced(gpu, smollm2_runner, label: str) -> tuple[np.ndarray, float]:
    """Logit cosines and top-1 agreement of one teacher-forced prefill, GPU against NumPy."""
    ids = DATA["teacher"]["ids"]
    ref = smollm2_runner.forward(prefill_step([ids]), all_logits=True)
    got = gpu.forward(prefill_step([ids]), all_logits=True)
    cos = cosines(got, ref)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    print(f"{label} vs NumPy: min cosine {cos.min():.5f}, mean {cos.mean():.5f}, top-1 agreement {agree:.4f}")
    return cos, agree


def test_smollm2_matches_the_numpy_runner(smollm2_gpu, smollm2_runner):
    cos, agree = teacher_forced(smollm2_gpu, smollm2_runner, "SmolLM2 GPU")
    assert cos.min() >= 0.999 and agree >= 0.99


def test_smollm2_fp8_kv_cache_stays_close(smollm2, smollm2_runner):
    """--kv-cache-dtype fp8 on the real model: the prompt's keys and values are written to
    the e4m3 cache and read back by the prefill attention. e4m3 keeps 3 mantissa bits, and
    that costs SmolLM2 some accuracy whatever the kernels do: the NumPy runner with its K/V
    rounded to e4m3 agrees with its float32 self on 97.3 % of the top-1 tokens here (mean
    cosine 0.9977, min 0.965); the GPU run measured 96.9 % (0.9970, 0.950)."""
    gpu = cuda_runner(smollm2, kv_dtype="fp8")
    assert gpu.k_cache.dtype == np.uint8
    cos, agree = teacher_forced(gpu, smollm2_runner, "SmolLM2 fp8 K/V")
    assert cos.mean() >= 0.995 and cos.min() >= 0.9 and agree >= 0.95


@pytest.mark.parametrize("accumulation", ["fast", "promoted"])
def test_smollm2_fp8_weights_stay_close(smollm2, smollm2_runner, accumulation):
    """--quantization fp8 on the real model: the teacher-forced prefill runs cuBLASLt's e4m3
    products (weights with a scale per feature, activations per token), with fast accumulation
    (the default) or promoted sums, a few decode-sized steps the skinny GEMM on e4m3 weights;
    both against the float32 NumPy runner. The checkpoint is Q4_1 (4-bit blocks of 32)
    requantized to e4m3 rows, and every product's input is rounded to e4m3 as well: on the H200
    the prefill (promoted sums) measured mean cosine 0.988 (min 0.654 at one position) and
    92.5 % top-1 agreement."""
    from kernels_cuda import gemm as G
    gpu = cuda_runner(smollm2, quantization="fp8", fp8_accumulation=accumulation)
    assert type(gpu.weights.layers[0].qkv_proj).__name__ == "Fp8Matrix"
    cos, agree = teacher_forced(gpu, smollm2_runner, f"SmolLM2 fp8 weights, {accumulation} accumulation")
    assert {key[4] for key in G._lt.plans if key[0] > 16} >= {accumulation == "fast"}  # the prefill's products
    assert cos.mean() >= 0.98 and agree >= 0.9
    ids = DATA["teacher"]["ids"][:12]  # 12 rows: the skinny GEMM's fp8 path
    got = gpu.forward(prefill_step([ids]), all_logits=True)
    ref = smollm2_runner.forward(prefill_step([ids]), all_logits=True)
    cos, agree = cosines(got, ref), float((got.argmax(1) == ref.argmax(1)).mean())
    print(f"SmolLM2 fp8 weights, 12-row step: min cosine {cos.min():.5f}, top-1 agreement {agree:.4f}")
    assert cos.min() >= 0.95 and agree >= 0.6  # H200: min cosine 0.973, 8 of 12 top-1


def test_smollm2_fp8_lm_head_costs_little_more(smollm2, smollm2_runner, monkeypatch):
    """--quantize-lm-head on the real model (its tied embedding as the LM head, in e4m3 rows):
    the teacher-forced prefill, fp8 layers with and without it, both against the float32 NumPy
    runner. The head's own rounding costs less than the layers' (the bounds below are the fp8
    layers' test's). With each row's largest logits rescored from the 16-bit embedding
    (LM_HEAD_RESCORE) the two runs pick the same top-1 token everywhere but at a near-tie (H200:
    226 of 226); without, at ~94 % of the positions."""
    base = cuda_runner(smollm2, quantization="fp8")
    head = cuda_runner(smollm2, quantization="fp8", quantize_lm_head=True)
    assert type(head.weights.lm_head).__name__ == "Fp8Matrix"
    cos0, agree0 = teacher_forced(base, smollm2_runner, "SmolLM2 fp8 layers")
    cos1, agree1 = teacher_forced(head, smollm2_runner, "SmolLM2 fp8 layers and LM head")
    ids = DATA["teacher"]["ids"]
    a = base.forward(prefill_step([ids]), all_logits=True)
    b = head.forward(prefill_step([ids]), all_logits=True)
    same = float((a.argmax(1) == b.argmax(1)).mean())
    print(f"SmolLM2 fp8 LM head against the 16-bit head: min cosine {cosines(a, b).min():.5f}, "
          f"top-1 the same at {same:.4f} of {len(ids)} positions")
    assert cos1.mean() >= 0.98 and agree1 >= 0.9 and same >= 0.995
    # the 16-bit head's largest logit a row was among the fp8 head's 8 largest, so rescored: exact (its
    # third largest was not at one position of 226 on the H200: 15.79 there read 14.24 in e4m3)
    rows, best = np.arange(len(a)), a.argmax(1)
    np.testing.assert_allclose(b[rows, best], a[rows, best], rtol=1e-4, atol=1e-3)
    import engine.runner.cuda_runner as cr
    monkeypatch.setattr(cr, "LM_HEAD_RESCORE", 0)
    plain = cuda_runner(smollm2, quantization="fp8", quantize_lm_head=True)
    assert plain.lm_head_exact is None and plain.buffers.head_cand is None
    c = plain.forward(prefill_step([ids]), all_logits=True)
    print(f"... not rescored: top-1 the same at {float((a.argmax(1) == c.argmax(1)).mean()):.4f}")


@pytest.mark.parametrize("name,kv_dtype,quant,dtype", [
    ("llama", "auto", None, None), ("qwen2", "auto", None, None), ("mistral", "auto", None, None),
    ("llama_tied_mha", "auto", None, None), ("llama_hd64", "fp8", None, None), ("mistral_hd32", "fp8", None, None),
    ("qwen2", "auto", "fp8", None), ("llama_hd64", "fp8", "fp8", None),
    ("llama", "auto", None, "bfloat16"), ("qwen2", "auto", "fp8", "bfloat16"), ("mistral", "auto", None, "run-bf16"),
    ("llama_hd64", "fp8", None, "bfloat16"), ("llama_hd128", "fp8", None, None)])
def test_tiny_models_match_the_numpy_runner(tmp_path, name, kv_dtype, quant, dtype):
    """A ragged prefill through the eager path, then decode steps through execute()
    (the captured graph), against the NumPy runner's logits; with an fp8 K/V cache the
    keys and values are rounded to e4m3 (3 mantissa bits), and with fp8 weights the
    matrices and their inputs, so the bounds are looser. A bfloat16 checkpoint runs in
    bfloat16, its prefill (over GEMV_MAX_ROWS rows) with a bfloat16 residual stream; so does a
    float32 one run with --dtype bfloat16 ("run-bf16"). "llama_hd128": the 8B shapes' heads (128
    dims, 4 query heads a KV head), whose fp8 decode attention takes q K^T on wgmma on Hopper."""
    saved, run = (None, "bfloat16") if dtype == "run-bf16" else (dtype, "auto")
    base, config = (("llama_hd64", dict(hidden_size=512, num_attention_heads=4, num_key_value_heads=1))
                    if name == "llama_hd128" else (name, None))
    path = build_tiny_model(tmp_path, base, seed=5, config=config, dtype=saved)
    model = load_model(str(path), with_tokenizer=False)
    ref_runner = NumpyRunner(model.config, model.weights, num_kv_slots=REGION * 3, max_model_len=REGION,
                             progress=False)
    gpu = cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype, quantization=quant, dtype=run)
    assert gpu.graphs
    assert gpu.k_cache.dtype == (np.uint8 if kv_dtype == "fp8" else gpu.scalar)
    assert gpu.residual_16 == (dtype is not None) and gpu.scalar == (np.uint16 if dtype else np.float16)
    r = np.random.default_rng(3)
    prompts = [r.integers(0, VOCAB, n).tolist() for n in (5, 17, 130)]  # ragged, one over two prefill tiles
    cont = [r.integers(0, VOCAB, 6).tolist() for _ in prompts]
    ref = [ref_runner.forward(prefill_step(prompts), all_logits=True)]
    got = [gpu.forward(prefill_step(prompts), all_logits=True)]
    pos = [len(p) for p in prompts]
    greedy = SamplingParams(temperature=0)
    for step in range(6):
        out = decode_step([c[step] for c in cont], [p + step for p in pos])
        ref.append(ref_runner.forward(out))
        for row in out.seqs:
            row.sampling = greedy
        sampled = gpu.execute(out).sampled
        logits = cp.asnumpy(gpu.buffers.logits[:len(prompts)])
        got.append(logits)
        assert [sampled[i] for i in range(len(prompts))] == list(logits.argmax(1))
    ref, got = np.concatenate(ref), np.concatenate(got)
    cos = cosines(got, ref)
    agree = (got.argmax(1) == ref.argmax(1)).mean()
    print(f"{name} {dtype or ''} ({kv_dtype} K/V, weights {quant or '16-bit'}): min cosine {cos.min():.5f}, "
          f"mean {cos.mean():.5f}, top-1 agreement {agree:.4f}")
    if quant == "fp8":
        assert cos.mean() >= 0.99 and agree >= 0.8
    elif kv_dtype == "fp8":
        assert cos.min() >= 0.99 and agree >= 0.9
    else:  # bfloat16 keeps 8 bits to float16's 11: a near tie of a random tiny model may flip
        assert cos.min() >= 0.999 and agree >= (0.95 if dtype else 0.99)


@pytest.mark.parametrize("products", [("gate_up",), ("qkv", "o", "gate_up", "down")])
def test_fp8_products_scaled_in_the_epilogue_stay_close(tmp_path, products, monkeypatch):
    """cuda_runner.EPILOGUE_SCALES: a ragged prefill of 152 rows (its bucket made to qualify
    here) whose fp8 products have cuBLASLt apply their scales, against the same runner with
    raw sums that their readers scale: the same model up to where bfloat16 rounds the
    products (a value rounded the other way may take the next e4m3 code when the product
    after it quantizes it: H200, min cosine 0.9983-0.9990 to the raw sums' logits), and no
    farther from the NumPy runner than the raw sums are."""
    from engine.runner import cuda_runner as cr
    from kernels_cuda import gemm
    model = load_model(str(build_tiny_model(tmp_path, "llama_hd64", seed=5)), with_tokenizer=False)
    ref_runner = NumpyRunner(model.config, model.weights, num_kv_slots=REGION * 3, max_model_len=REGION,
                             progress=False)
    r = np.random.default_rng(4)
    step = prefill_step([r.integers(0, VOCAB, n).tolist() for n in (5, 17, 130)])
    raw = cuda_runner(model, max_model_len=REGION, quantization="fp8").forward(step, all_logits=True)
    monkeypatch.setattr(cr, "EPILOGUE_SCALES", products)
    monkeypatch.setattr(cr, "EPILOGUE_SCALES_MIN_BUCKET", 32)
    got = cuda_runner(model, max_model_len=REGION, quantization="fp8").forward(step, all_logits=True)
    if any(bucket[0] == gemm.rows_bucket(152) for bucket in gemm._lt.unscalable):  # the prefill's bucket
        pytest.skip("this cuBLASLt has no fp8 algorithm with outer-vector scales")
    ref = ref_runner.forward(step, all_logits=True)
    to_raw, to_ref, raw_to_ref = cosines(got, raw), cosines(got, ref), cosines(raw, ref)
    agree = float((got.argmax(1) == ref.argmax(1)).mean())
    print(f"scaled {products}: min cosine to raw sums {to_raw.min():.6f}; to NumPy min {to_ref.min():.5f}, mean "
          f"{to_ref.mean():.5f} (raw sums: {raw_to_ref.min():.5f}, {raw_to_ref.mean():.5f}), top-1 agreement {agree:.4f}")
    assert not np.array_equal(got, raw)  # the scaled products ran
    assert to_raw.min() >= 0.995
    assert to_ref.mean() >= raw_to_ref.mean() - 5e-4 and to_ref.min() >= raw_to_ref.min() - 2e-3 and agree >= 0.8


def decode_graph_against_eager(model, n: int, steps: int = 3, **runner_args) -> np.ndarray:
    """n decode rows (more than GEMV_MAX_ROWS: a captured bucket past the skinny GEMM) after a
    prefill, through a graphed runner and an eager one: their logits must be the same bits.
    Returns the cosines of the graphed logits to the NumPy runner's."""
    from engine.runner.cuda_runner import GEMV_MAX_ROWS
    assert n > GEMV_MAX_ROWS
    ref_runner = NumpyRunner(model.config, model.weights, num_kv_slots=REGION * n, max_model_len=REGION,
                             progress=False)
    graphed = cuda_runner(model, max_model_len=REGION, max_num_seqs=32, **runner_args)
    eager = cuda_runner(model, max_model_len=REGION, max_num_seqs=32, eager=True, **runner_args)
    assert graphed.graphs
    r = np.random.default_rng(7)
    prompts = [r.integers(0, VOCAB, k).tolist() for k in [11] * 16 + [10] * (n - 16)]
    for runner in (ref_runner, graphed, eager):
        runner.forward(prefill_step(prompts))
    pos = [len(p) for p in prompts]
    greedy = SamplingParams(temperature=0)
    ref, got = [], []
    for step in range(steps):
        tokens = r.integers(0, VOCAB, n).tolist()
        ref.append(ref_runner.forward(decode_step(tokens, [p + step for p in pos])))
        logits = []
        for runner in (graphed, eager):
            out = decode_step(tokens, [p + step for p in pos])
            for row in out.seqs:
                row.sampling = greedy
            runner.execute(out)
            logits.append(cp.asnumpy(runner.buffers.logits[:n]))
        np.testing.assert_array_equal(logits[0], logits[1])
        got.append(logits[0])
    return cosines(np.concatenate(got), np.concatenate(ref))


def test_bfloat16_decode_graph_past_the_skinny_gemm(tmp_path):
    """24 decode rows of a bfloat16 checkpoint replay the 32-row bucket's graph, whose residual
    stream is bfloat16 (more than GEMV_MAX_ROWS rows): close to the NumPy runner, and the bits of
    the eager path (a prefill of 256 tokens: a captured count)."""
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=5, dtype="bfloat16")), with_tokenizer=False)
    cos = decode_graph_against_eager(model, 24)
    print(f"bfloat16, 24 decode rows: min cosine {cos.min():.5f}")
    assert cos.min() >= 0.999


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_bfloat16_prefill_norms_with_a_thread_group_a_row(tmp_path, quant, monkeypatch):
    """rmsnorm.add_rms_norm_rows (a group of threads a row; here from one row on, 32 threads a row
    of 256) in a bfloat16 checkpoint's ragged prefill, whose residual stream is bfloat16: as close
    to the NumPy runner as norm_row's blocks (the sums of squares add in another order), and
    close to them."""
    from kernels_cuda import rmsnorm
    path = build_tiny_model(tmp_path, "llama", seed=5, dtype="bfloat16", config=dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    model = load_model(str(path), with_tokenizer=False)
    ref_runner = NumpyRunner(model.config, model.weights, num_kv_slots=REGION * 3, max_model_len=REGION,
                             progress=False)
    r = np.random.default_rng(3)
    step = prefill_step([r.integers(0, VOCAB, n).tolist() for n in (5, 17, 130)])
    ref = ref_runner.forward(step, all_logits=True)
    monkeypatch.setattr(rmsnorm, "ROW_THREADS", 32)
    got = {}
    for rows_min in (1 << 30, 1):  # norm_row; add_rms_norm_rows
        monkeypatch.setattr(rmsnorm, "ROWS_MIN_ROWS", rows_min)
        gpu = cuda_runner(model, max_model_len=REGION, quantization=quant)
        assert gpu.residual_16 and rmsnorm.rows_kernel(152, 256, 1, 1) == (rows_min == 1)
        got[rows_min] = gpu.forward(step, all_logits=True)
    old, new = cosines(got[1 << 30], ref), cosines(got[1], ref)
    between = cosines(got[1], got[1 << 30])
    print(f"bfloat16 prefill ({quant or '16-bit'}): min cosine to NumPy {new.min():.5f} (norm_row {old.min():.5f}), "
          f"to norm_row {between.min():.5f}")
    assert new.min() >= min(old.min(), 0.999 if quant is None else 0.99) - 1e-3
    assert between.min() >= (0.999 if quant is None else 0.99)


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_residual_adds_in_the_products_epilogue_stay_close(tmp_path, step, monkeypatch):
    """cuda_runner.ADD_IN_EPILOGUE (here o and down): a bfloat16 checkpoint's fp8 products add to
    its 16-bit residual stream in cuBLASLt's epilogue, and the norms after them read the stream alone
    (buckets made to qualify here: a ragged prefill of 152 rows; 24 decode rows replaying the
    32-row bucket's graph, which gives the eager path's bits). As close to the NumPy runner as
    the same runner with the products added by the norms."""
    from engine.runner import cuda_runner as cr
    from kernels_cuda import gemm, rmsnorm
    path = build_tiny_model(tmp_path, "llama", seed=5, dtype="bfloat16", config=dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    model = load_model(str(path), with_tokenizer=False)
    monkeypatch.setattr(rmsnorm, "ROW_THREADS", 32)
    monkeypatch.setattr(cr, "EPILOGUE_SCALES_MIN_BUCKET", 32)
    adds, scaled = [], cr.gemm_fp8_scaled

    def counted(*args, **kwargs):
        done = scaled(*args, **kwargs)
        adds.append(done and kwargs.get("add", False))
        return done

    monkeypatch.setattr(cr, "gemm_fp8_scaled", counted)
    cos = {}
    for add in (False, True):
        monkeypatch.setattr(cr, "ADD_IN_EPILOGUE", ("o", "down") if add else ())
        adds.clear()
        if step == "prefill":
            ref_runner = NumpyRunner(model.config, model.weights, num_kv_slots=REGION * 3, max_model_len=REGION,
                                     progress=False)
            r = np.random.default_rng(3)
            prefill = prefill_step([r.integers(0, VOCAB, n).tolist() for n in (5, 17, 130)])
            gpu = cuda_runner(model, max_model_len=REGION, quantization="fp8")
            assert gpu._epilogue_adds(152, "o") == gpu._epilogue_adds(152, "down") == add
            cos[add] = cosines(gpu.forward(prefill, all_logits=True), ref_runner.forward(prefill, all_logits=True))
        else:
            cos[add] = decode_graph_against_eager(model, 24, quantization="fp8")
        if any(bucket[0] == 32 for bucket in gemm._lt.unscalable):
            pytest.skip("this cuBLASLt has no fp8 algorithm with outer-vector scales")
        assert any(adds) == add  # o and down added in their epilogue, or not
    print(f"{step}: min cosine to NumPy {cos[True].min():.5f} (added by the norms {cos[False].min():.5f}), "
          f"mean {cos[True].mean():.5f} ({cos[False].mean():.5f})")
    assert cos[True].min() >= cos[False].min() - 2e-3 and cos[True].mean() >= cos[False].mean() - 5e-4
    assert cos[True].min() >= 0.99


@pytest.mark.parametrize("quant,kv_dtype,dtype", [(None, "auto", "auto"), ("fp8", "fp8", "bfloat16")],
                         ids=["16bit", "fp8-bfloat16"])
def test_prefill_rope_in_items_gives_the_same_logits(tmp_path, quant, kv_dtype, dtype, monkeypatch):
    """rope.rope_kv_write_rows (steps of rope.ROWS_MIN_ROWS tokens or more; here from one token
    on) in a ragged prefill, then decode steps that read the K/V it wrote: the logits of the
    one-block-a-token form, bit for bit."""
    from kernels_cuda import rope
    path = build_tiny_model(tmp_path, "llama", seed=7, config=dict(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    model = load_model(str(path), with_tokenizer=False)
    r = np.random.default_rng(4)
    prompts = [r.integers(0, VOCAB, n).tolist() for n in (5, 17, 130)]
    got = {}
    for rows_min in (1 << 30, 1):
        monkeypatch.setattr(rope, "ROWS_MIN_ROWS", rows_min)
        assert (rope.rows_items(3, 4, 2, 64) > 0) == (rows_min == 1)
        gpu = cuda_runner(model, max_model_len=REGION, quantization=quant, kv_dtype=kv_dtype, dtype=dtype, eager=True)
        logits = [gpu.forward(prefill_step(prompts), all_logits=True)]
        nxt = [int(np.argmax(logits[0][i])) for i in np.cumsum([len(p) for p in prompts]) - 1]
        logits.append(gpu.forward(decode_step(nxt, [len(p) for p in prompts])))
        got[rows_min] = logits
    for a, b in zip(got[1], got[1 << 30]):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)


def test_fp8_products_on_wgmma_in_the_decode_graph(tmp_path, monkeypatch):
    """--quantization fp8 with gemm_fp8.cu made to win every tuning (gemm.TUNE_MIN_GAIN -1): the
    decode buckets' products of a model whose shapes fit it (K a multiple of 128, features of 64)
    run on wgmma, launched with PDL in the graphs and without in the eager runner, with the same
    bits; close to the NumPy runner as the fp8 products through cuBLASLt are."""
    from kernels_cuda import gemm as G
    if not G.wgmma_supported():
        pytest.skip("gemm_fp8.cu needs an sm_90 GPU")
    monkeypatch.setattr(G, "TUNE_MIN_GAIN", -1.0)
    monkeypatch.setattr(G, "_wgmma_plans", {})
    monkeypatch.setattr(G, "_lt", None)  # shapes timed by earlier tests are timed again (gemm.fp8_tuned)
    path = build_tiny_model(tmp_path, "llama", seed=5, config=dict(hidden_size=256, intermediate_size=512,
                                                                   num_attention_heads=4, num_key_value_heads=2))
    model = load_model(str(path), with_tokenizer=False)
    cos = decode_graph_against_eager(model, 24, quantization="fp8")
    shapes = {(512, 256), (256, 256), (1024, 256), (256, 512)}  # qkv, o, gate/up, down: (N, K)
    assert {(n, k) for (m, n, k, _), c in G._wgmma_plans.items() if m == 32 and c is not None} == shapes
    print(f"fp8 products on wgmma, 24 decode rows: min cosine {cos.min():.5f}, mean {cos.mean():.5f}")
    assert cos.mean() >= 0.99 and cos.min() >= 0.95


@pytest.mark.parametrize("name", ["llama", "llama_tied_mha"])
def test_fp8_lm_head_stays_close(tmp_path, name):
    """--quantize-lm-head: the LM head as an Fp8Matrix (a tied one beside the 16-bit embedding,
    an untied one instead of its 16-bit form), counted so in the weights' bytes. Its logits stay
    close to the 16-bit head's with the same fp8 layers: a prompt's rows through cuBLASLt's
    epilogue-scaled product into float32, a 5-row decode step through the skinny GEMM's fp8 path,
    and 24 decode rows through the captured graph (the same bits as eager) against NumPy."""
    from kernels_cuda.quant import Fp8Matrix
    path = build_tiny_model(tmp_path, name, seed=5)
    model = load_model(str(path), with_tokenizer=False)
    base = cuda_runner(model, max_model_len=REGION, quantization="fp8")
    head = cuda_runner(model, max_model_len=REGION, quantization="fp8", quantize_lm_head=True)
    w0, w1 = base.weights, head.weights
    assert isinstance(w1.lm_head, Fp8Matrix) and not isinstance(w1.embed_tokens, Fp8Matrix)
    assert (w0.lm_head is w0.embed_tokens) == model.config.tie_word_embeddings
    untied = 0 if model.config.tie_word_embeddings else w0.lm_head.nbytes
    assert head.weight_bytes - base.weight_bytes == w1.lm_head.nbytes - untied
    assert head.decode_step_bytes(0) - base.decode_step_bytes(0) == w1.lm_head.nbytes - w0.lm_head.nbytes
    r = np.random.default_rng(3)
    prompts = [r.integers(0, VOCAB, k).tolist() for k in (23, 9, 17)]
    logits = {}
    for key, runner in (("base", base), ("head", head)):
        prefill = runner.forward(prefill_step(prompts), all_logits=True)  # 49 rows
        step = decode_step([5, 6, 7], [len(p) for p in prompts])
        for row in step.seqs:
            row.sampling = SamplingParams(temperature=0)
        runner.execute(step)
        logits[key] = (prefill, cp.asnumpy(runner.buffers.logits[:3]))
    for label, a, b in zip(("prefill", "decode"), logits["head"], logits["base"]):
        cos = cosines(a, b)
        print(f"fp8 LM head ({name}), {label}: min cosine {cos.min():.5f} to the 16-bit head's, "
              f"max error {np.abs(a - b).max() / np.abs(b).max():.4f} of the largest")
        assert np.isfinite(a).all() and cos.min() >= 0.995
        # each row's largest logits rescored from the 16-bit form (LM_HEAD_RESCORE): its greedy token
        rows = np.arange(len(b))
        np.testing.assert_array_equal(a.argmax(1), b.argmax(1))
        np.testing.assert_allclose(a[rows, b.argmax(1)], b.max(1), rtol=1e-4, atol=1e-4)
    exact = head.lm_head_exact  # the 16-bit form the rescore reads: the embedding, or the untied head kept
    assert exact is not None and exact.dtype == head.scalar and exact.shape == w1.lm_head.shape
    if model.config.tie_word_embeddings:
        assert exact is head.weights.embed_tokens
    else:
        np.testing.assert_array_equal(cp.asnumpy(exact), cp.asnumpy(w0.lm_head))
    cos = decode_graph_against_eager(model, 24, quantization="fp8", quantize_lm_head=True)
    print(f"fp8 LM head ({name}), 24 decode rows: min cosine {cos.min():.5f}, mean {cos.mean():.5f} to NumPy")
    assert cos.mean() >= 0.99 and cos.min() >= 0.95


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_mixed_step_attention_on_two_streams_gives_the_same_bits(tmp_path, kv_dtype):
    """A step of decode rows and prompts runs the prompts' attention on a side stream beside
    the decode rows' (overlap_attention): the same logits, bit for bit, as one after the other."""
    model = load_model(str(build_tiny_model(tmp_path, "llama_hd64", seed=5)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype)
    r = np.random.default_rng(4)
    prompts = [r.integers(0, VOCAB, n).tolist() for n in (40, 70)]
    gpu.forward(prefill_step(prompts))
    later = [r.integers(0, VOCAB, n).tolist() for n in (90, 3)]
    # two decode rows (sequences 0 and 1) first, then two new prompts, as the scheduler orders them
    mixed = SchedulerOutput([ScheduledSeq(i, [7 + i], len(p), i * REGION, True) for i, p in enumerate(prompts)]
                            + [ScheduledSeq(2 + j, p, 0, (2 + j) * REGION, True) for j, p in enumerate(later)])
    got = {}
    for overlap in (False, True, False):
        gpu.overlap_attention = overlap
        got.setdefault(overlap, []).append(gpu.forward(mixed, all_logits=True))
    np.testing.assert_array_equal(got[False][0], got[False][1])  # the step rewrites the same K/V rows
    np.testing.assert_array_equal(got[True][0], got[False][0])


@pytest.mark.parametrize("kv_dtype,dtype", [("auto", "float16"), ("fp8", "bfloat16")])
def test_prompt_attention_on_wgmma_gives_the_same_logits(tmp_path, kv_dtype, dtype, monkeypatch):
    """On Hopper the prompts' attention runs flash_prefill_wgmma.cu (here for every launch of
    this head-dim-64 model: WGMMA_MIN_KEYS 0): a prefill of three prompts (one over three query
    tiles) and a step of decode rows and new prompts give flash_prefill.cu's logits, bit for
    bit, in float16 and bfloat16, with a 16-bit and an e4m3 cache."""
    import kernels_cuda.flash_prefill as fp
    from kernels_cuda._module import wgmma_supported
    if not wgmma_supported():
        pytest.skip("flash_prefill_wgmma.cu needs an sm_90 GPU")
    monkeypatch.setattr(fp, "WGMMA_MIN_KEYS", dict.fromkeys(fp.WGMMA_MIN_KEYS, 0))
    model = load_model(str(build_tiny_model(tmp_path, "llama_hd64", seed=5)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype, dtype=dtype)
    r = np.random.default_rng(6)
    prompts = [r.integers(0, VOCAB, n).tolist() for n in (40, 150, 70)]
    later = [r.integers(0, VOCAB, n).tolist() for n in (90, 3)]
    mixed = SchedulerOutput([ScheduledSeq(i, [7 + i], len(p), i * REGION, True) for i, p in enumerate(prompts)]
                            + [ScheduledSeq(3 + j, p, 0, (3 + j) * REGION, True) for j, p in enumerate(later)])
    got = {}
    for wgmma in (True, False):
        monkeypatch.setattr(fp, "WGMMA", wgmma)
        got[wgmma] = (gpu.forward(prefill_step(prompts), all_logits=True), gpu.forward(mixed, all_logits=True))
    for on, off in zip(got[True], got[False]):
        assert np.isfinite(on).all()
        np.testing.assert_array_equal(on, off)


TAIL_MODELS = [("llama_hd64", "auto", None, "auto"), ("llama_hd64", "fp8", "fp8", "bfloat16"),
               ("qwen2", "auto", None, "bfloat16"), ("mistral", "auto", None, "auto")]


def attention_in_graph(monkeypatch) -> None:
    """Runners built after this hold a ragged step's attention in its graphs (ATTENTION_IN_GRAPH)
    for a head-dim-64 model too: its prompt attention on flash_prefill_wgmma.cu at every length."""
    import kernels_cuda.flash_prefill as fp
    from kernels_cuda._module import wgmma_supported
    if not wgmma_supported():
        pytest.skip("the prompts' attention reads its tile count on the device in flash_prefill_wgmma.cu: sm_90")
    monkeypatch.setattr(fp, "WGMMA_MIN_KEYS", dict.fromkeys(fp.WGMMA_MIN_KEYS, 0))


@pytest.mark.parametrize("name,kv_dtype,quant,dtype,eager,in_graph",
                         [(*m, eager, False) for m in TAIL_MODELS for eager in (False, True)]
                         + [(*m, False, True) for m in TAIL_MODELS[:2]])
def test_ragged_steps_run_their_last_layer_for_the_sampling_rows_only(tmp_path, name, kv_dtype, quant, dtype, eager,
                                                                      in_graph, monkeypatch):
    """A ragged step of more than 16 tokens runs its last layer past the K/V write for the rows
    that sample only (sampled_tail, on by default): 20 decode rows beside a prompt that samples
    and a chunk that does not (21 rows: the cuBLAS path), a lone prompt (1 row: the skinny GEMM,
    from a bfloat16 stream into a float32 one), 3 decode rows beside two prompts (5 rows). Their
    logits stay as close to the whole last layer's as products of another row count allow
    (fp8: its activations quantized at 21 rows, not at 1-5), and the K/V the step leaves is the
    same: the decode step after it gives the same logits, bit for bit. Graphed (in_graph: the
    graphs hold every layer's attention but the last's) and eager."""
    from engine.runner.cuda_runner import CudaRunner
    if in_graph:
        attention_in_graph(monkeypatch)
    model = load_model(str(build_tiny_model(tmp_path, name, seed=5)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, max_num_seqs=32, kv_dtype=kv_dtype, quantization=quant,
                      dtype=dtype, eager=eager)
    assert gpu.sampled_tail and bool(gpu.ragged_graphs) != eager and gpu.ragged_attention_in_graph == in_graph
    tails = []
    tail = CudaRunner._sampled_tail
    monkeypatch.setattr(CudaRunner, "_sampled_tail", lambda self, *a: tails.append(a[2]) or tail(self, *a))
    greedy = SamplingParams(temperature=0)
    r = np.random.default_rng(11)

    def tokens(n: int) -> list[int]:
        return r.integers(0, VOCAB, n).tolist()

    def row(seq: int, ids: list[int], start: int, sample: bool = True) -> ScheduledSeq:
        return ScheduledSeq(seq, ids, start, seq * REGION, sample, greedy if sample else None)

    gpu.forward(prefill_step([tokens(3) for _ in range(20)]))
    steps = [[*(row(s, [5 + s], 3) for s in range(20)), row(20, tokens(90), 0), row(21, tokens(40), 0, False)],
             [row(22, tokens(200), 0)],
             [*(row(s, [9], 3) for s in range(3)), row(23, tokens(30), 0), row(24, tokens(7), 0)]]
    for step in steps:
        sampling = [x for x in step if x.sample]
        after = decode_step([3] * len(sampling), [x.kv_len for x in sampling])
        for x, y in zip(after.seqs, sampling):
            x.seq_id, x.kv_start, x.sampling = y.seq_id, y.kv_start, greedy
        got, next_logits = {}, {}
        for on in (False, True):  # each run writes the same K/V rows again
            gpu.sampled_tail = on
            sampled = gpu.execute(SchedulerOutput(step)).sampled
            got[on] = cp.asnumpy(gpu.buffers.logits[:len(sampling)])
            assert [sampled[x.seq_id] for x in sampling] == list(got[on].argmax(1))
            gpu.execute(after)
            next_logits[on] = cp.asnumpy(gpu.buffers.logits[:len(sampling)])
        assert tails[-1] == len(sampling) and len(tails) == steps.index(step) + 1
        np.testing.assert_array_equal(next_logits[True], next_logits[False])
        cos = cosines(got[True], got[False])
        assert cos.min() >= (0.998 if quant else 0.9999), cos
        rows = np.arange(len(sampling))
        gap = got[False].max(1) - got[False][rows, got[True].argmax(1)]
        assert (gap <= (2e-2 if quant else 1e-3) * np.abs(got[False]).max(1)).all(), gap


@pytest.mark.parametrize("kv_dtype,quant", [("auto", None), ("fp8", "fp8")])
def test_warm_up_leaves_serving_steps_nothing_to_build(tmp_path, kv_dtype, quant, monkeypatch):
    """Building the runner runs its ragged path at each power of two of tokens up to the step
    budget (_warm_up) and the launches that path's steps vary by (_warm_up_first_uses), so the
    steps serving makes next build no kernel module, compile no CuPy kernel and query no
    cuBLASLt algorithm: no compile lands in a first request's time to first token. Prompts
    alone (past the wide kernels' 512 rows), decode rows beside a short prompt (2 and 5 rows:
    the decode attention's launch bounds follow the row count), a chunk after a prefix, a few
    tokens, 20 decode rows beside a prompt (the products of its sampling rows' last layer at
    their count: no cuBLASLt plan built there either); each sampling. (CuPy keeps its kernels
    for the process: its part of the check bites where no earlier test built the same gathers.
    The 16-bit LM head's warm-up at each count is not seen here: cuBLAS loads its kernels
    unseen; bench/serve.py --engine's first load shows it.)"""
    import cupy.cuda.compiler as cupy_compiler

    from kernels_cuda import _module, gemm
    monkeypatch.setattr(_module, "_MODULES", {})  # what other tests built does not count
    monkeypatch.setattr(gemm, "_lt", None)
    model = load_model(str(build_tiny_model(tmp_path, "llama_hd64", seed=5)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype, quantization=quant, max_num_seqs=32)
    built = set(_module._MODULES)
    algos = set(gemm._lt.algos) if gemm._lt is not None else set()
    plans = set(gemm._lt.plans) if gemm._lt is not None else set()
    compiled = []
    compile_module = cupy_compiler._compile_module_with_cache
    monkeypatch.setattr(cupy_compiler, "_compile_module_with_cache",
                        lambda *a, **k: compiled.append(a[:1]) or compile_module(*a, **k))
    r = np.random.default_rng(6)

    def prompt(n: int) -> list[int]:
        return r.integers(0, VOCAB, n).tolist()

    def row(seq: int, tokens: list[int], start: int, sample: bool = True) -> ScheduledSeq:
        return ScheduledSeq(seq, tokens, start, seq * REGION, sample, SamplingParams(temperature=0.0) if sample else None)

    steps = [[row(0, prompt(300), 0), row(1, prompt(500), 0)],
             [row(0, [5], 300), row(1, [6], 500), row(2, prompt(3), 0)],
             [*(row(s, [7], 300) for s in range(5)), row(5, prompt(4), 0)],
             [row(3, prompt(200), 250)],
             [row(4, prompt(9), 0)],
             # one-token rows only, one of them a prompt's first chunk that samples nothing: the
             # ragged path with no prompt tiles (flash_prefill.tiles of nothing)
             [row(4, [8], 9), row(5, prompt(1), 0, sample=False)],
             # more sampling rows than the skinny GEMM takes beside a prompt: the last layer of the
             # sampling rows (_sampled_tail) and the LM head run their products at that count
             [*(row(s, [9], 300) for s in range(6, 26)), row(26, prompt(40), 0)]]
    for step in steps:  # every sampling row gets its token
        assert set(gpu.execute(SchedulerOutput(step)).sampled) == {x.seq_id for x in step if x.sample}
    assert set(_module._MODULES) == built, sorted(set(_module._MODULES) - built)
    assert not compiled, [src[0][:200] for src in compiled]
    if quant:
        assert set(gemm._lt.algos) == algos, sorted(set(gemm._lt.algos) - algos)
        assert set(gemm._lt.plans) == plans, sorted(set(gemm._lt.plans) - plans)


class CountedGraph:
    """A captured graph whose launches are counted."""

    def __init__(self, graph, counts: list) -> None:
        self.graph, self.counts = graph, counts

    def launch(self, stream) -> None:
        self.counts.append(1)
        self.graph.launch(stream)


@pytest.mark.parametrize("in_graph", [False, True], ids=["pieces", "in-graph"])
@pytest.mark.parametrize("kv_dtype,quant", [("auto", None), ("fp8", "fp8")])
def test_ragged_steps_replay_their_layers_graphs(tmp_path, kv_dtype, quant, in_graph, monkeypatch):
    """Prefill and mixed steps of up to RAGGED_GRAPH_TOKENS[-1] tokens replay their layers'
    graphs (padded to the next captured token count): in a piece a layer with the attention
    launched between them, or (in_graph, ATTENTION_IN_GRAPH) in two pieces whose first holds
    every layer's attention but the last's. At a captured count, the logits of every token are
    the eager path's, bit for bit (the mixed step's 10 decode rows take the split plan of the
    graph's 16: the same bucket); padded, as close as products of another row count allow
    (cuBLAS may pick another kernel); past the largest count the step runs eagerly."""
    from engine.runner import cuda_runner as runner_module
    from engine.runner.cuda_runner import RAGGED_GRAPH_TOKENS
    if in_graph:
        attention_in_graph(monkeypatch)
    else:
        monkeypatch.setattr(runner_module, "ATTENTION_IN_GRAPH", False)
    model = load_model(str(build_tiny_model(tmp_path, "llama_hd64", seed=5)), with_tokenizer=False)
    runners = {graphed: cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype, quantization=quant,
                                    eager=not graphed, budget=RAGGED_GRAPH_TOKENS[-1] + REGION)
               for graphed in (True, False)}
    assert not runners[False].ragged_graphs
    graphed = runners[True]
    assert graphed.ragged_attention_in_graph == in_graph
    assert list(graphed.ragged_graphs) == [t for t in RAGGED_GRAPH_TOKENS if t <= graphed.max_tokens]
    counts: list = []
    layers = graphed.config.num_layers
    graphed.ragged_graphs = {t: [(CountedGraph(g, counts), offset) for g, offset in pieces]
                             for t, pieces in graphed.ragged_graphs.items()}
    per_step = 2 if in_graph else layers + 1
    assert all(len(pieces) == per_step for pieces in graphed.ragged_graphs.values())
    r = np.random.default_rng(8)
    first = [r.integers(0, VOCAB, n).tolist() for n in (10, 6, 8, 4, 7, 5, 9, 3, 6, 6)]  # 64 tokens: a captured count
    mixed = SchedulerOutput([ScheduledSeq(i, [9 + i], len(p), i * REGION, True) for i, p in enumerate(first)]
                            + [ScheduledSeq(10, r.integers(0, VOCAB, 118).tolist(), 0, 10 * REGION, True)])  # 128
    padded = [prefill_step([r.integers(0, VOCAB, n).tolist() for n in (5,)]),  # 5 -> 16: the skinny GEMM
              SchedulerOutput([ScheduledSeq(11, r.integers(0, VOCAB, 150).tolist(), 0, 11 * REGION, True),
                               ScheduledSeq(12, r.integers(0, VOCAB, 30).tolist(), 0, 12 * REGION, True)])]  # 180: 192
    exact = [prefill_step(first), mixed]
    for step in exact + padded:
        got = {g: runner.forward(step, all_logits=True) for g, runner in runners.items()}
        if step in exact:
            np.testing.assert_array_equal(got[True], got[False])
        else:
            assert_close_logits(got)
    assert len(counts) == len(exact + padded) * per_step
    big = max(graphed.ragged_graphs) + 1  # in pieces of at most REGION - 1 tokens
    assert big <= graphed.max_tokens and graphed._ragged_graph_tokens(big) is None
    sizes = [REGION - 1] * (big // (REGION - 1)) + [big % (REGION - 1)]
    graphed.forward(SchedulerOutput([ScheduledSeq(13 + i, [1] * n, 0, (13 + i) * REGION, False)
                                     for i, n in enumerate(sizes) if n]))
    assert len(counts) == len(exact + padded) * per_step  # eagerly: no graph launched


def event_record_nodes(graph) -> int:
    """The event-record nodes of a captured graph (CU_GRAPH_NODE_TYPE_EVENT_RECORD)."""
    import ctypes

    from kernels_cuda._module import _cuda_driver
    driver, handle, n = _cuda_driver(), ctypes.c_void_p(graph.graph), ctypes.c_size_t(0)
    assert driver.cuGraphGetNodes(handle, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert driver.cuGraphGetNodes(handle, nodes, ctypes.byref(n)) == 0 and n.value > 0
    kinds = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        assert driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
        kinds.append(kind.value)
    return kinds.count(7)


@pytest.mark.parametrize("in_graph", [False, True], ids=["pieces", "in-graph"])
def test_ragged_graphs_mark_where_a_step_nears_its_end(tmp_path, in_graph, monkeypatch):
    """The mark wait_near_end waits for (SchedulerConfig.late_ahead), before layer
    near_end_layer's attention of a ragged step, is recorded at each replay: where a graph
    holds that attention (in_graph), as a node of it (a plain record in a capture adds none and
    leaves the event one the host cannot wait for), else eagerly between the pieces; decode
    graphs record none. A graphed mixed step, then wait_near_end: the step has passed the mark."""
    from engine.runner import cuda_runner as runner_module
    if in_graph:
        attention_in_graph(monkeypatch)
    else:
        monkeypatch.setattr(runner_module, "ATTENTION_IN_GRAPH", False)
    model = load_model(str(build_tiny_model(tmp_path, "llama_hd64", seed=5, config={"num_hidden_layers": 8})),
                       with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION)
    assert gpu.ragged_attention_in_graph == in_graph and gpu.near_end_layer == 6
    for pieces in gpu.ragged_graphs.values():
        assert [event_record_nodes(g) for g, _ in pieces] == ([1, 0] if in_graph else [0] * 9)
    assert all(event_record_nodes(g) == 0 for both in gpu.graphs.values() for g in both)
    r = np.random.default_rng(3)
    prompts = [r.integers(0, VOCAB, n).tolist() for n in (30, 20)]
    gpu.forward(prefill_step(prompts))
    mixed = [ScheduledSeq(i, [5 + i], len(p), i * REGION, True, SamplingParams(temperature=0))
             for i, p in enumerate(prompts)] + [ScheduledSeq(2, r.integers(0, VOCAB, 60).tolist(), 0, 2 * REGION, True,
                                                             SamplingParams(temperature=0))]
    finish = gpu.submit(SchedulerOutput(mixed))
    gpu.wait_near_end()
    assert gpu._near_end.done
    assert sorted(finish().sampled) == [0, 1, 2]


def assert_close_logits(got: dict) -> None:
    """Logits of a fused path (got[True]) against the separate kernels' (got[False]): as close
    as a change in the order of sums allows, and the same top token or one within rounding of
    the top (a tiny random model's near ties)."""
    cos = cosines(got[True], got[False])
    assert cos.min() >= 0.9999, cos
    rows = np.arange(len(got[False]))
    gap = got[False].max(1) - got[False][rows, got[True].argmax(1)]
    assert (gap <= 1e-3 * np.abs(got[False]).max(1)).all(), gap


def fused_decode_matches(gpu, flag: str, r: np.random.Generator) -> list[list[int]]:
    """Prefill three prompts, then four decode steps each run with gpu.<flag> off and on (the
    step rewrites the same K/V rows): close logits (assert_close_logits). Returns the prompts."""
    prompts = [r.integers(0, VOCAB, n).tolist() for n in (5, 40, 130)]
    gpu.forward(prefill_step(prompts))
    pos = [len(p) for p in prompts]
    for step in range(4):
        out = decode_step([int(t) for t in r.integers(0, VOCAB, 3)], [p + step for p in pos])
        for row in out.seqs:
            row.sampling = SamplingParams(temperature=0)
        got = {}
        for fuse in (False, True):
            setattr(gpu, flag, fuse)
            gpu.execute(out)
            got[fuse] = cp.asnumpy(gpu.buffers.logits[:3])
        assert_close_logits(got)
    return prompts


def graphed_step_runs(model, prompts: list[list[int]], flag: str, **kwargs) -> None:
    """A runner built with its graphs (the module constant turned on by the caller) samples
    a token for each row of a decode step after the prompts."""
    graphed = cuda_runner(model, max_model_len=REGION, **kwargs)
    assert graphed.graphs and getattr(graphed, flag)
    out = decode_step([3, 4, 5], [len(p) for p in prompts])
    for row in out.seqs:
        row.sampling = SamplingParams(temperature=0)
    graphed.forward(prefill_step(prompts))
    assert len(graphed.execute(out).sampled) == 3


@pytest.mark.parametrize("name,kv_dtype", [("llama_hd64", "auto"), ("llama_hd64", "fp8"), ("qwen2", "auto"),
                                           ("mistral", "auto")])
def test_attention_block_in_one_kernel_matches_the_separate_kernels(tmp_path, name, kv_dtype, monkeypatch):
    """Decode steps of a small model may run the attention block as one kernel (_attn_block,
    off by default): the same step through the separate kernels gives logits as close as a
    change in the order of sums allows, and the same greedy tokens up to near ties; QKV bias
    (qwen2) and a sliding window (mistral, 6 keys) included. The captured graphs run it too."""
    import engine.runner.cuda_runner as cr
    model = load_model(str(build_tiny_model(tmp_path, name, seed=5)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype, eager=True)
    assert gpu.attn_block_fits and not gpu._attn_block(1)
    gpu.fuse_attention = True
    assert gpu._attn_block(1) and gpu._attn_block(16)
    prompts = fused_decode_matches(gpu, "fuse_attention", np.random.default_rng(6))
    monkeypatch.setattr(cr, "FUSE_ATTENTION", True)
    graphed_step_runs(model, prompts, "fuse_attention", kv_dtype=kv_dtype)


@pytest.mark.parametrize("name,kv_dtype", [("llama_hd64", "auto"), ("llama_hd64", "fp8"), ("qwen2", "auto"),
                                           ("mistral", "auto"), ("llama_tied_mha", "auto")])
def test_attention_and_o_in_one_kernel_match_the_separate_kernels(tmp_path, name, kv_dtype, monkeypatch):
    """Decode steps of a small model may run the attention and the o product as one kernel
    (_attn_o): the same step through the separate kernels gives logits as close as a change in
    the order of sums allows, and the same greedy tokens up to near ties; a sliding window
    (mistral, 6 keys) and an o bias (llama_tied_mha) included. The captured graphs run it too."""
    import engine.runner.cuda_runner as cr
    model = load_model(str(build_tiny_model(tmp_path, name, seed=5)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, kv_dtype=kv_dtype, eager=True)
    assert gpu.attn_o_fits
    gpu.fuse_attn_o = True
    assert gpu._attn_o(1) and gpu._attn_o(16) and not gpu._attn_o(17)
    prompts = fused_decode_matches(gpu, "fuse_attn_o", np.random.default_rng(6))
    monkeypatch.setattr(cr, "FUSE_ATTN_O", True)
    graphed_step_runs(model, prompts, "fuse_attn_o", kv_dtype=kv_dtype)


@pytest.mark.parametrize("name", ["llama_hd64", "llama_tied_mha"])
def test_mlp_block_in_one_kernel_matches_the_separate_kernels(tmp_path, name, monkeypatch):
    """Steps of up to 16 rows of a small model may run o .. down as one kernel (_mlp_block, off
    by default): a 6-token prefill and decode steps give logits as close as a change in the
    order of sums allows, and the same greedy tokens up to near ties, as the separate kernels;
    an o bias (llama_tied_mha) included. The captured graphs run it too."""
    import engine.runner.cuda_runner as cr
    model = load_model(str(build_tiny_model(tmp_path, name, seed=7, config={"intermediate_size": 256})),
                       with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=REGION, eager=True)
    assert gpu.mlp_block_fits and not gpu._mlp_block(1)
    gpu.fuse_mlp = True
    assert gpu._mlp_block(1) and gpu._mlp_block(16) and not gpu._mlp_block(17)
    r = np.random.default_rng(8)
    short = prefill_step([r.integers(0, VOCAB, 6).tolist()])
    got = {}
    for fuse in (False, True):
        gpu.fuse_mlp = fuse
        got[fuse] = gpu.forward(short, all_logits=True)
    assert_close_logits(got)
    prompts = fused_decode_matches(gpu, "fuse_mlp", r)
    monkeypatch.setattr(cr, "FUSE_MLP", True)
    graphed_step_runs(model, prompts, "fuse_mlp")


def test_tiny_fp8_kv_cache_needs_head_dim_multiple_of_32(tmp_path):
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=5)), with_tokenizer=False)  # head_dim 16
    with pytest.raises(ValueError, match="multiple of 32"):
        cuda_runner(model, max_model_len=REGION, kv_dtype="fp8")


def _prefill_then_decode(gpu, model, n: int, max_model_len: int) -> np.ndarray:
    """Cosines of the CUDA runner's logits to the NumPy runner's: an n-token prompt
    prefilled in chunks of 2,000 (each attending to the cached prefix), then three decode
    steps of one row through the graph."""
    ref_runner = NumpyRunner(model.config, model.weights, num_kv_slots=max_model_len, max_model_len=max_model_len,
                             progress=False)
    ids = np.random.default_rng(1).integers(0, VOCAB, n).tolist()
    ref, got = [], []
    for start in range(0, n, 2000):  # chunked prefill, as the scheduler does it
        chunk = SchedulerOutput([ScheduledSeq(0, ids[start:start + 2000], start, 0, True)])
        ref.append(ref_runner.forward(chunk))
        got.append(gpu.forward(chunk))
    greedy = SamplingParams(temperature=0)
    for step, tok in enumerate([5, 9, 11]):
        out = SchedulerOutput([ScheduledSeq(0, [tok], n + step, 0, True, greedy)])
        ref.append(ref_runner.forward(out))
        gpu.execute(out)
        got.append(cp.asnumpy(gpu.buffers.logits[:1]))
    return cosines(np.concatenate(got), np.concatenate(ref))


def test_long_context_uses_many_splits(tmp_path):
    """A 4500-token prompt, then decode steps through the graph with ~18 flash-decode splits."""
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=7)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=8192)
    assert gpu.max_splits >= 16
    cos = _prefill_then_decode(gpu, model, 4500, 8192)
    assert cos.min() >= 0.999, cos


def test_short_rows_of_one_row_steps_take_64_key_splits(tmp_path):
    """At B=1 a row of `whole` + 1 to `short` keys (the split plan's fourth field) is cut into
    splits of 64 keys: a 600-token prompt decodes in 10 of them, through the graph (the tiny
    model's 16-bit K/V of small heads in tile groups, whose rows of up to 512 keys take one split)."""
    from engine.runner.cuda_runner import GROUPED_WHOLE_KEYS
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=7)), with_tokenizer=False)
    gpu = cuda_runner(model, max_model_len=2048)
    _, splits, whole, short, grouped = gpu.splits[1]
    assert grouped and whole == GROUPED_WHOLE_KEYS < 600 and short >= 640 and splits * 64 >= short
    cos = _prefill_then_decode(gpu, model, 600, 2048)
    assert cos.min() >= 0.999, cos


def _decode_rows(runner, B: int, step: int):
    rows = [ScheduledSeq(i, [(7 * i + step) % 1000 + 3], 10 + step, i * 64, True,
                         SamplingParams(temperature=0), rng_seed=i) for i in range(B)]
    return SchedulerOutput(rows)


def test_graph_replay_equals_eager_bit_for_bit(smollm2):
    graphed = cuda_runner(smollm2, max_num_seqs=8)
    eager = cuda_runner(smollm2, max_num_seqs=8, eager=True)
    assert graphed.graphs and not eager.graphs
    prompt = [SchedulerOutput([ScheduledSeq(i, list(range(5, 15)), 0, i * 64, True, SamplingParams(temperature=0))
                               for i in range(5)])]
    for r in (graphed, eager):
        r.execute(prompt[0])
    for step in range(4):
        a = graphed.execute(_decode_rows(graphed, 5, step))
        b = eager.execute(_decode_rows(eager, 5, step))
        assert a.sampled == b.sampled
        np.testing.assert_array_equal(cp.asnumpy(graphed.buffers.logits[:5]), cp.asnumpy(eager.buffers.logits[:5]))


@pytest.mark.parametrize("rows", [1, 5, 24])
def test_early_triggers_replay_eager_bit_for_bit(smollm2, rows, monkeypatch):
    """With EARLY_TRIGGER_MAX_HIDDEN at SmolLM2's size (the default), its decode graphs are built
    from kernels that let the next one launch before their wait (common.cuh's EARLY_TRIGGER; the
    embedding's stays after its wait): tokens and logits stay those of eager steps, bit for bit, at
    one row (the folded norms, whose layer-0 QKV product follows the embedding), at five, and at 24
    (past the skinny products' rows). Not with fp8 layer weights."""
    import engine.runner.cuda_runner as cr
    from kernels_cuda import _module
    monkeypatch.setattr(cr, "EARLY_TRIGGER_MAX_HIDDEN", 1024)
    seqs = max(8, rows)
    graphed = cuda_runner(smollm2, max_num_seqs=seqs)
    eager = cuda_runner(smollm2, max_num_seqs=seqs, eager=True)
    assert graphed.early_launch and graphed.graphs and not eager.graphs
    if rows == 1:  # fp8 layer weights keep the default form (cuda_runner.EARLY_TRIGGER_MAX_HIDDEN)
        assert not cuda_runner(smollm2, max_num_seqs=8, eager=True, quantization="fp8").early_launch
    assert any(key[0] == "gemv" and ("EARLY_TRIGGER", 1) in key[2] for key in _module._MODULES)
    prompt = SchedulerOutput([ScheduledSeq(i, list(range(5, 15)), 0, i * 64, True, SamplingParams(temperature=0))
                              for i in range(rows)])
    for r in (graphed, eager):
        r.execute(prompt)
    for step in range(4):
        a = graphed.execute(_decode_rows(graphed, rows, step))
        b = eager.execute(_decode_rows(eager, rows, step))
        assert a.sampled == b.sampled
        np.testing.assert_array_equal(cp.asnumpy(graphed.buffers.logits[:rows]),
                                      cp.asnumpy(eager.buffers.logits[:rows]))


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_q8_0_lm_head_stays_with_its_16_bit_form(smollm2, dtype, monkeypatch):
    """SmolLM2's GGUF stores its (tied) embedding as Q8_0. Where kept as it is (cuda_runner.Q8_LM_HEAD;
    by default only from Q8_LM_HEAD_MIN_HIDDEN on, which SmolLM2's 576 is not: lowered here), products
    of up to GEMV_MAX_ROWS rows read it, 53 % of the 16-bit form's bytes. Its values are the 16-bit
    form's and only the order of the float32 sums differs, so the logits of a prompt's last rows
    (eager) and of decode steps (the graphs) stay within float32 rounding of the 16-bit form's, in the
    file's float16 and in bfloat16. The roofline counts the bytes such steps read."""
    import engine.runner.cuda_runner as cr
    assert cuda_runner(smollm2, max_num_seqs=8, eager=True).lm_head_q8 is None  # hidden 576: 16-bit
    monkeypatch.setattr(cr, "Q8_LM_HEAD_MIN_HIDDEN", 0)
    got = {}
    for on in (True, False):
        monkeypatch.setattr(cr, "Q8_LM_HEAD", on)
        gpu = cuda_runner(smollm2, max_num_seqs=8, dtype=dtype)
        assert (gpu.lm_head_q8 is not None) == on and gpu.graphs
        if on:
            q8, w16 = gpu.lm_head_q8.nbytes, gpu.weights.lm_head.nbytes
            assert q8 == w16 // 2 * 34 // 32
            assert gpu.decode_step_bytes(0, 16) - gpu.decode_step_bytes(0, 17) == q8 - w16
        logits = [gpu.forward(prefill_step([list(range(5, 40)), list(range(60, 71))]))]
        gpu.execute(SchedulerOutput([ScheduledSeq(i, list(range(5, 15)), 0, i * 64, True,
                                                  SamplingParams(temperature=0)) for i in range(5)]))
        for step in range(3):
            gpu.execute(_decode_rows(gpu, 5, step))
            logits.append(cp.asnumpy(gpu.buffers.logits[:5]))
        got[on] = logits
    for a, b in zip(got[True], got[False]):
        assert np.isfinite(a).all() and a.any()
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * np.abs(b).max())
        assert (a.argmax(-1) == b.argmax(-1)).all()


def test_only_the_captured_graphs_launch_with_pdl(smollm2, monkeypatch):
    """Programmatic dependent launch goes through cuLaunchKernelEx (ctypes, ~22 us of host
    time a kernel, against ~5 through CuPy): the decode graphs are captured with it, and a
    replay costs no host time; eager steps (prefill, mixed, decode without a graph) launch
    without it."""
    from kernels_cuda import _module
    driver = _module._cuda_driver()

    class Counting:
        launches = 0

        def cuLaunchKernelEx(self, *args):
            Counting.launches += 1
            return driver.cuLaunchKernelEx(*args)

    monkeypatch.setattr(_module, "_cuda_driver", Counting)
    for eager in (False, True):
        Counting.launches = 0
        runner = cuda_runner(smollm2, max_num_seqs=8, eager=eager)
        assert (Counting.launches > 0) == (runner.pdl and not eager)  # while capturing
        Counting.launches = 0
        runner.execute(SchedulerOutput([ScheduledSeq(i, list(range(5, 40)), 0, i * 64, True,
                                                     SamplingParams(temperature=0)) for i in range(3)]))
        for step in range(2):
            runner.execute(_decode_rows(runner, 3, step))
        assert Counting.launches == 0
        assert not runner._launch_pdl


@pytest.fixture(scope="module")
def gpu_engine(smollm2, smollm2_path):
    config = EngineConfig(model=smollm2_path, device="cuda", cache=CacheConfig(kv_cache_bytes=2 << 30),
                          scheduler=SchedulerConfig(max_model_len=2048, max_num_seqs=32))
    return Engine(config, model=smollm2)


def generate(engine, prompts, params):
    outs = {}
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode(p)
        engine.add_request(ids, params, lambda o, i=i: outs.setdefault(i, []).append(o))
    while engine.has_work():
        engine.step()
    return [[t for o in outs[i] for piece in o.outputs for t in piece.token_ids] for i in range(len(prompts))]


PROMPTS = ["The capital of France is", "def quicksort(arr):", "Once upon a time,", "The three primary colors are",
           "To be or not to be,", "import numpy as np\n", "My favourite food is", "In 1969, the first man on"]


def test_engine_greedy_on_gpu_and_batch_invariance(gpu_engine):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    together = generate(gpu_engine, PROMPTS, params)
    for i, p in enumerate(PROMPTS):
        assert generate(gpu_engine, [p], params)[0] == together[i], p
    text = gpu_engine.tokenizer.decode(together[0])
    assert text.startswith(" Paris"), text


def test_engine_sampling_features_on_gpu(gpu_engine):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=3, logprobs=2,
                            repetition_penalty=1.2, logit_bias={11: -5.0})
    # Bitwise batch invariance holds for steps of up to 16 tokens (the skinny GEMM) whose
    # prompts are prefilled whole: 5 + 5 prompt tokens here. A larger step goes through
    # cuBLAS, whose rounding depends on the row count, so a seeded draw may then differ.
    a = generate(gpu_engine, [PROMPTS[2]], seeded)[0]
    b = generate(gpu_engine, [PROMPTS[0], PROMPTS[2]], seeded)[1]
    assert a == b and len(a) == 16
    stop = generate(gpu_engine, ["Count: 1, 2, 3,"], SamplingParams(max_tokens=40, temperature=0,
                                                                     stop_token_ids=[gpu_engine.tokenizer.encode(",")[0]]))
    assert len(stop[0]) < 40
    n3 = generate(gpu_engine, ["Once upon a time"], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=5))
    assert len(n3[0]) == 24
    assert gpu_engine.scheduler.kv.usage == 0.0


def test_steps_launched_ahead_give_the_same_outputs(gpu_engine):
    """Decode steps launched before the previous step's update (input tokens taken on the
    device, two steps' outputs in flight) give the same bits as steps launched one by one:
    seeded sampling, penalties, min_tokens, logprobs and stop tokens included."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=11, logprobs=1, min_tokens=4,
                            repetition_penalty=1.1, frequency_penalty=0.2,
                            stop_token_ids=[gpu_engine.tokenizer.encode(".")[0]])

    def run(ahead: bool):
        gpu_engine.schedule_ahead = ahead
        outs = {}
        for i, p in enumerate(PROMPTS):
            gpu_engine.add_request(gpu_engine.tokenizer.encode(p), params, lambda o, i=i: outs.setdefault(i, []).append(o))
        chained = 0
        while gpu_engine.has_work():
            gpu_engine.step()
            chained += gpu_engine._ahead is not None
        return chained, [[(t, lp.logprob) for o in outs[i] for c in o.outputs
                          for t, lp in zip(c.token_ids, c.logprobs)] for i in range(len(PROMPTS))]
    try:
        chained, got = run(True)
        none, want = run(False)
    finally:
        gpu_engine.schedule_ahead = True
    assert chained > 5 and none == 0
    assert got == want and all(len(w) >= 4 for w in want)
    assert gpu_engine.scheduler.kv.usage == 0.0


def test_tiny_admissions_launched_ahead_give_the_same_outputs(tmp_path):
    """Requests that arrive while others decode, admitted in steps launched ahead (prompt
    chunks beside decode rows whose input tokens the runner takes on the device, after a
    decode or a ragged step) sample the same tokens as steps launched one at a time. Steps
    of at most 16 tokens keep every row's arithmetic independent of the step around it (the
    skinny GEMM; contexts of under 256 keys take one attention split)."""
    from engine.kv_cache import KVCache
    from engine.request import Request
    from engine.scheduler import Scheduler
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=3)), with_tokenizer=False)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, repetition_penalty=1.1, ignore_eos=True)

    def run(ahead: bool):
        done = []
        runner = cuda_runner(model, max_model_len=256, max_num_seqs=16)
        s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, prompts_ahead=True),
                      KVCache(runner.num_kv_slots, 16), 256, 8, (2,))
        requests = [Request(f"r{i}", [(11 * i + j) % (VOCAB - 3) + 3 for j in range(5 + 3 * (i % 4))], params)
                    for i in range(10)]
        launched, step, with_prompts = None, 0, 0
        while requests or s.has_work() or launched is not None:
            if requests and step % 2 == 0:  # an arrival every other step
                r = requests.pop(0)
                s.add_request(r, [int(r.request_id[1:])])
                done.append(r)
            step += 1
            if launched is None:
                out = s.schedule()
                if out.is_empty:
                    continue
                launched = (out, runner.submit(out))
            out, finish = launched
            nxt = s.schedule_ahead(out, runner.chain_rows) if ahead else None
            with_prompts += nxt is not None and any(not r.pending_tokens for r in nxt.seqs)
            launched = (nxt, runner.submit(nxt)) if nxt is not None else None
            s.update(out, finish())
        return with_prompts, [r.seqs[0].output_token_ids for r in done]

    with_prompts, got = run(True)
    _, want = run(False)
    assert with_prompts >= 2
    assert got == want and all(len(w) == 12 for w in want)


def test_greedy_rows_take_their_token_from_the_lm_heads_keys(tmp_path, monkeypatch):
    """GREEDY_KEYS: steps of greedy rows (with and without a repetition penalty, beside sampled
    rows; prompt steps and decode graphs) sample the same tokens with the LM head's keys as from
    its logits alone, and the keys do reach the sampling kernel."""
    import engine.runner.cuda_runner as cr
    from engine.kv_cache import KVCache
    from engine.request import Request
    from engine.scheduler import Scheduler
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=4)), with_tokenizer=False)
    kinds = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.7, ignore_eos=True)]
    real, keyed = cr.sample_tokens, []

    def spy(*args, keys=None, **kwargs):
        keyed.append(keys is not None)
        return real(*args, keys=keys, **kwargs)
    monkeypatch.setattr(cr, "sample_tokens", spy)

    def run(on: bool) -> list[list[int]]:
        monkeypatch.setattr(cr, "GREEDY_KEYS", on)
        keyed.clear()
        runner = cuda_runner(model, max_model_len=256, max_num_seqs=16)
        s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
                      KVCache(runner.num_kv_slots, 16), 256, 8, ())
        requests = [Request(f"r{i}", [(7 * i + j) % (VOCAB - 3) + 3 for j in range(4 + i)], kinds[i % 3])
                    for i in range(7)]
        for i, r in enumerate(requests):
            s.add_request(r, [i])
        while s.has_work():
            out = s.schedule()
            if not out.is_empty:
                s.update(out, runner.submit(out)())
        return [r.seqs[0].output_token_ids for r in requests]

    want = run(False)
    assert keyed and not any(keyed)
    got = run(True)
    assert any(keyed)
    assert got == want and all(len(w) == 10 for w in want)


def test_prompt_logprobs_on_gpu_match_cpu(gpu_engine, smollm2_runner):
    ids = gpu_engine.tokenizer.encode("The capital of France is Paris")
    outs = []
    gpu_engine.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=2), outs.append)
    while gpu_engine.has_work():
        gpu_engine.step()
    lps = [o for o in outs if o.prompt_logprobs is not None][0].prompt_logprobs
    ref = smollm2_runner.forward(prefill_step([ids]), all_logits=True)
    ref_lp = ref - np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1, keepdims=True)) - ref.max(1, keepdims=True)
    assert [lp.token_id for lp in lps] == ids[1:]
    for j, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(ref_lp[j, ids[j + 1]], abs=0.05)
