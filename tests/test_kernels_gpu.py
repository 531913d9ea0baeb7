"""Every CUDA kernel against a short NumPy reference, on awkward sizes (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

from engine.loader.quants import bf16_to_f32, f32_to_bf16_bits  # noqa: E402
from engine.outputs import ScheduledSeq, SchedulerOutput  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from engine.runner.sampling import log_softmax, sample_rows  # noqa: E402

DTYPES = ["float16", "bfloat16"]


def to_dev(x: np.ndarray, dtype: str) -> cp.ndarray:
    if dtype == "bfloat16":
        return cp.asarray(f32_to_bf16_bits(x))
    return cp.asarray(x.astype(np.float16))


def from_dev(x: cp.ndarray) -> np.ndarray:
    host = cp.asnumpy(x)
    return bf16_to_f32(host) if host.dtype == np.uint16 else host.astype(np.float32)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the 16-bit type stores it, back in float32."""
    return bf16_to_f32(f32_to_bf16_bits(x)) if dtype == "bfloat16" else x.astype(np.float16).astype(np.float32)


def tol(dtype: str) -> float:
    return 2e-2 if dtype == "bfloat16" else 3e-3


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


def e4m3_values() -> np.ndarray:
    """The value of each of the 256 float8 e4m3 codes (NaN for 0x7f and 0xff)."""
    codes = np.arange(256)
    exp, man = (codes >> 3) & 0xF, codes & 7
    val = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
    val = np.where(codes & 0x80, -val, val)
    val[(codes & 0x7F) == 0x7F] = np.nan
    return val.astype(np.float32)


E4M3 = e4m3_values()
E4M3_POS = E4M3[:0x7F]  # codes 0..126, increasing


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """The nearest e4m3 code of each value (saturating at +-448)."""
    a = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(E4M3_POS, a), 1, len(E4M3_POS) - 1)
    code = np.where(a - E4M3_POS[hi - 1] <= E4M3_POS[hi] - a, hi - 1, hi)
    return (code | np.where(x < 0, 0x80, 0)).astype(np.uint8)


def assert_e4m3_of(codes: np.ndarray, ref: np.ndarray) -> None:
    """codes hold ref rounded to e4m3: within half a step of 3 mantissa bits (plus the
    float32 noise of how ref was computed), saturated at 448."""
    got = E4M3[codes]
    step = np.maximum(np.abs(ref), 2.0 ** -6) * 2.0 ** -3
    np.testing.assert_array_less(np.abs(got - np.clip(ref, -448, 448)), 0.5 * step + 1e-6)


rng = np.random.default_rng(0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(dtype):
    from kernels_cuda.embedding import embedding
    table = rng.standard_normal((111, 40)).astype(np.float32)
    ids = rng.integers(0, 111, 13).astype(np.int32)
    out = embedding(cp.asarray(ids), to_dev(table, dtype))
    np.testing.assert_array_equal(cp.asnumpy(out), rounded(table, dtype)[ids])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1000, 1002, 9000])  # in registers; not a multiple of 4; longer than they hold
def test_rms_norm_and_fused_add(dtype, hidden):
    from kernels_cuda.rmsnorm import add_rms_norm, rms_norm
    x = rng.standard_normal((7, hidden)).astype(np.float32)
    d = rng.standard_normal((7, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    bias = rng.standard_normal(hidden).astype(np.float32)
    odt = np.uint16 if dtype == "bfloat16" else np.float16

    def ref(v):
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-5) * w

    out = rms_norm(cp.asarray(x), cp.asarray(w), 1e-5, out_dtype=odt)
    assert rel(from_dev(out), ref(x)) < tol(dtype)
    res = cp.asarray(x)
    out = add_rms_norm(res, cp.asarray(d), cp.asarray(w), 1e-5, bias=cp.asarray(bias), out_dtype=odt)
    np.testing.assert_allclose(cp.asnumpy(res), x + d + bias, rtol=1e-6, atol=1e-6)
    assert rel(from_dev(out), ref(x + d + bias)) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    from kernels_cuda.activation import silu_mul
    gu = rng.standard_normal((5, 666)).astype(np.float32) * 4
    g, u = gu[:, :333], gu[:, 333:]
    out = silu_mul(cp.asarray(gu), out_dtype=np.uint16 if dtype == "bfloat16" else np.float16)
    assert rel(from_dev(out), g / (1 + np.exp(-g)) * u) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
def test_rope_kv_write(dtype, head_dim, with_bias, kv8):
    from kernels_cuda.rope import rope_kv_write
    T, H, KVH, layers = 9, 6, 2, 3
    qkv = rng.standard_normal((T, (H + 2 * KVH) * head_dim)).astype(np.float32)
    bias = rng.standard_normal(qkv.shape[1]).astype(np.float32) if with_bias else None
    pos = rng.integers(0, 20, T).astype(np.int32)
    starts = rng.permutation(T) * 24  # each token its own region: no two tokens share a slot
    slots = T * 24
    inv = 1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.arange(64)[:, None] * inv[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    layer = 1
    scalar = np.uint16 if dtype == "bfloat16" else np.float16
    k_cache = cp.zeros((layers, slots, KVH, head_dim), np.uint8 if kv8 else scalar)
    v_cache = cp.zeros_like(k_cache)
    slot_bytes = KVH * head_dim * k_cache.itemsize
    kp = cp.asarray(k_cache.data.ptr + starts * slot_bytes, dtype=cp.int64)
    vp = cp.asarray(v_cache.data.ptr + starts * slot_bytes, dtype=cp.int64)
    q_out = cp.zeros((T, H, head_dim), scalar)
    rope_kv_write(cp.asarray(qkv), cp.asarray(pos), cp.asarray(cos), cp.asarray(sin), kp, vp,
                  layer * slots * KVH * head_dim, H, KVH, head_dim, q_out,
                  bias=cp.asarray(bias) if with_bias else None, kv_fp8=kv8)
    x = qkv + (bias if with_bias else 0)
    heads = x.reshape(T, H + 2 * KVH, head_dim)
    half = head_dim // 2
    c, s = cos[pos][:, None], sin[pos][:, None]
    rot = np.concatenate([heads[..., :half] * c - heads[..., half:] * s, heads[..., half:] * c + heads[..., :half] * s], -1)
    assert rel(from_dev(q_out), rot[:, :H]) < tol(dtype)
    if kv8:
        kc, vc = cp.asnumpy(k_cache), cp.asnumpy(v_cache)
        for t in range(T):
            assert_e4m3_of(kc[layer, starts[t] + pos[t]], rot[t, H:H + KVH])
            assert_e4m3_of(vc[layer, starts[t] + pos[t]], heads[t, H + KVH:])
    else:
        kc, vc = from_dev(k_cache), from_dev(v_cache)
        for t in range(T):
            assert rel(kc[layer, starts[t] + pos[t]], rot[t, H:H + KVH]) < tol(dtype)
            assert rel(vc[layer, starts[t] + pos[t]], heads[t, H + KVH:]) < tol(dtype)
    assert not kc[0].any() and not kc[2].any()  # other layers untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("K", [264, 112, 4096])
def test_gemv(dtype, B, K):
    from kernels_cuda.gemv import gemv
    x = rng.standard_normal((B, K)).astype(np.float32)
    w = rng.standard_normal((111, K)).astype(np.float32)
    out = gemv(to_dev(x, dtype), to_dev(w, dtype))
    ref = rounded(x, dtype).astype(np.float64) @ rounded(w, dtype).T.astype(np.float64)
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-4, atol=2e-3 * np.sqrt(K / 264))


def test_gemv_rows_do_not_depend_on_the_batch():
    from kernels_cuda.gemv import gemv
    x = to_dev(rng.standard_normal((16, 520)).astype(np.float32), "float16")
    w = to_dev(rng.standard_normal((100, 520)).astype(np.float32), "float16")
    together = cp.asnumpy(gemv(x, w))
    for b in range(16):
        np.testing.assert_array_equal(cp.asnumpy(gemv(x[b:b + 1], w))[0], together[b])
    np.testing.assert_array_equal(cp.asnumpy(gemv(x[:8], w)), together[:8])  # the 8-row kernel too


@pytest.mark.parametrize("config", [{"WARPS": 8, "DEPTH": 8}, {"WARPS": 4, "DEPTH": 4}, {"WARPS": 16, "DEPTH": 2}],
                         ids=["w8d8", "w4d4", "w16d2"])
@pytest.mark.parametrize("B", [1, 6, 13])
def test_gemv_configs(config, B):
    """Shapes of the skinny GEMM's block, on K with a partial last pass and N past a tile."""
    from kernels_cuda.gemv import gemv
    for K in (520, 4104):
        x = rng.standard_normal((B, K)).astype(np.float32)
        w = rng.standard_normal((77, K)).astype(np.float32)
        out = gemv(to_dev(x, "float16"), to_dev(w, "float16"), config=config)
        ref = rounded(x, "float16").astype(np.float64) @ rounded(w, "float16").T.astype(np.float64)
        np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-4, atol=2e-3 * np.sqrt(K / 264))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 5, 12])
def test_gemv_silu_is_gemv_then_silu_mul(dtype, B):
    """The gate/up product with SiLU * up in its epilogue gives the bits of the two kernels."""
    from kernels_cuda.activation import silu_mul
    from kernels_cuda.gemv import gemv, gemv_silu
    inter, K = 88, 264  # 22 blocks of 4 gate/up pairs (up to 8 rows) or 11 of 8
    x = to_dev(rng.standard_normal((B, K)).astype(np.float32), dtype)
    w = to_dev(rng.standard_normal((2 * inter, K)).astype(np.float32) * 0.2, dtype)
    fused = gemv_silu(x, w, cp.zeros((B, inter), w.dtype))
    separate = silu_mul(gemv(x, w), out_dtype=w.dtype)
    np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(separate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("B", [1, 11])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
def test_gemv_rope_is_gemv_then_rope_kv_write(dtype, head_dim, B, kv8):
    """The QKV product with RoPE and the K/V write in its epilogue gives the bits of the two
    kernels: q, and the cache (other slots and layers untouched)."""
    from kernels_cuda.gemv import gemv, gemv_rope
    from kernels_cuda.rope import rope_kv_write
    H, KVH, K, layers, layer = 6, 2, 136, 2, 1
    width = (H + 2 * KVH) * head_dim
    x = to_dev(rng.standard_normal((B, K)).astype(np.float32), dtype)
    w = to_dev(rng.standard_normal((width, K)).astype(np.float32) * 0.2, dtype)
    bias = cp.asarray(rng.standard_normal(width).astype(np.float32))
    pos = cp.asarray(rng.integers(0, 30, B).astype(np.int32))
    ang = np.arange(32)[:, None] / 10000 ** (np.arange(0, head_dim, 2) / head_dim)[None]
    cos, sin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    slots = B * 32
    results = []
    for run in ("fused", "separate"):
        kc = cp.zeros((layers, slots, KVH, head_dim), np.uint8 if kv8 else w.dtype)
        vc = cp.zeros_like(kc)
        starts = cp.arange(B, dtype=cp.int64) * 32 * KVH * head_dim * kc.itemsize
        kp, vp = kc.data.ptr + starts, vc.data.ptr + starts
        q = cp.zeros((B, H, head_dim), w.dtype)
        args = (pos, cos, sin, kp, vp, layer * slots * KVH * head_dim, H, KVH)
        if run == "fused":
            gemv_rope(x, w, *args, q, bias=bias, kv_fp8=kv8)
        else:
            rope_kv_write(gemv(x, w), *args, head_dim, q, bias=bias, kv_fp8=kv8)
        results.append([cp.asnumpy(a) for a in (q, kc, vc)])
    for fused, separate in zip(*results):
        np.testing.assert_array_equal(fused, separate)
    assert results[0][1][layer].any() and not results[0][1][0].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm(dtype):
    from kernels_cuda.gemm import gemm
    x = rng.standard_normal((37, 200)).astype(np.float32)
    w = rng.standard_normal((111, 200)).astype(np.float32)
    out = gemm(to_dev(x, dtype), to_dev(w, dtype))
    ref = rounded(x, dtype).astype(np.float64) @ rounded(w, dtype).T.astype(np.float64)
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-3, atol=1e-2)


# --------------------------------------------------------------------- attention


def ref_attention(q, keys, values, q_positions, window=0):
    """q (n, H, D); keys/values (L, KVH, D) of one sequence; causal by position."""
    n, H, D = q.shape
    KVH = keys.shape[1]
    G = H // KVH
    out = np.zeros_like(q, dtype=np.float64)
    for i in range(n):
        p = q_positions[i]
        lo = max(0, p - window + 1) if window else 0
        for h in range(H):
            k = keys[lo:p + 1, h // G].astype(np.float64)
            v = values[lo:p + 1, h // G].astype(np.float64)
            s = k @ q[i, h].astype(np.float64) / np.sqrt(D)
            e = np.exp(s - s.max())
            out[i, h] = (e / e.sum()) @ v
    return out


def make_cache(dtype, layers, slots, KVH, D, kv8=False):
    """Random K and V pools: (keys, values as the kernels see them in float32, device K, V)."""
    kc = rng.standard_normal((layers, slots, KVH, D)).astype(np.float32)
    vc = rng.standard_normal((layers, slots, KVH, D)).astype(np.float32)
    if kv8:
        k8, v8 = to_e4m3(kc), to_e4m3(vc)
        return E4M3[k8], E4M3[v8], cp.asarray(k8), cp.asarray(v8)
    return rounded(kc, dtype), rounded(vc, dtype), to_dev(kc, dtype), to_dev(vc, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 12, 3), (128, 6, 1), (128, 8, 8)])
@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("chunk", [64, 256])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
def test_flash_decode(dtype, head_dim, heads, kv_heads, window, chunk, kv8):
    from kernels_cuda.flash_decode import flash_decode
    # 4000: 16 splits of 256 or 63 of 64; 0: a padding row (left untouched); 129: a tile's keys past the end
    kv_lens = np.array([1, 17, 129, 300, 4000, 0], np.int32)
    starts = np.array([0, 10, 50, 100, 500, 0])
    layers, layer, slots = 2, 1, 4600
    kr, vr, dk, dv = make_cache(dtype, layers, slots, kv_heads, head_dim, kv8)
    B = len(kv_lens)
    q = rng.standard_normal((B, heads, head_dim)).astype(np.float32)
    slot_bytes = kv_heads * head_dim * dk.itemsize
    kp = cp.asarray(dk.data.ptr + starts * slot_bytes, dtype=cp.int64)
    vp = cp.asarray(dv.data.ptr + starts * slot_bytes, dtype=cp.int64)
    S = -(-int(kv_lens.max()) // chunk)
    counters = cp.zeros((B, kv_heads), np.int32)
    outs = []
    for _ in range(2):  # the last block of each (row, KV head) combines and leaves its counter at 0
        qd = to_dev(q, dtype)
        out = cp.zeros((B, heads, head_dim), qd.dtype)
        flash_decode(qd, kp, vp, cp.asarray(kv_lens), layer * slots * kv_heads * head_dim, kv_heads,
                     cp.zeros((B, heads, S, head_dim), np.float32), cp.zeros((B, heads, S, 2), np.float32), counters,
                     out, 1 / np.sqrt(head_dim), chunk=chunk, window=window, kv_fp8=kv8)
        assert not counters.any()
        outs.append(cp.asnumpy(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    got = from_dev(out)
    qr = rounded(q, dtype)
    for b in range(B):
        if kv_lens[b] == 0:
            assert not got[b].any()
            continue
        L = kv_lens[b]
        ref = ref_attention(qr[b:b + 1], kr[layer, starts[b]:starts[b] + L], vr[layer, starts[b]:starts[b] + L],
                            [L - 1], window)[0]
        assert rel(got[b], ref) < tol(dtype), (b, rel(got[b], ref))


def check_flash_prefill(dtype, H, KVH, head_dim, q_lens, start_pos, region_starts, layers, layer, slots, window,
                        kv8=False):
    """Ragged chunks (q_lens) after cached prefixes (start_pos) in regions of the cache,
    against the reference attention of each sequence."""
    from kernels_cuda.flash_prefill import flash_prefill, tiles
    q_lens, start_pos = np.asarray(q_lens, np.int32), np.asarray(start_pos, np.int32)
    region_starts = np.asarray(region_starts)
    kv_lens = start_pos + q_lens
    kr, vr, dk, dv = make_cache(dtype, layers, slots, KVH, head_dim, kv8)
    T = int(q_lens.sum())
    q = rng.standard_normal((T, H, head_dim)).astype(np.float32)
    q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    slot_bytes = KVH * head_dim * dk.itemsize
    tile_seq, tile_q0 = tiles(q_lens)
    qd = to_dev(q, dtype)
    out = cp.zeros((T, H, head_dim), qd.dtype)
    flash_prefill(qd, cp.asarray(tile_seq), cp.asarray(tile_q0), cp.asarray(q_start),
                  cp.asarray(q_lens), cp.asarray(kv_lens.astype(np.int32)),
                  cp.asarray(dk.data.ptr + region_starts * slot_bytes, dtype=cp.int64),
                  cp.asarray(dv.data.ptr + region_starts * slot_bytes, dtype=cp.int64),
                  layer * slots * KVH * head_dim, KVH, 1 / np.sqrt(head_dim), out, window=window, kv_fp8=kv8)
    got = from_dev(out)
    qr = rounded(q, dtype)
    for s in range(len(q_lens)):
        sl = slice(q_start[s], q_start[s] + q_lens[s])
        r0 = region_starts[s]
        ref = ref_attention(qr[sl], kr[layer, r0:r0 + kv_lens[s]], vr[layer, r0:r0 + kv_lens[s]],
                            np.arange(start_pos[s], kv_lens[s]), window)
        assert rel(got[sl], ref) < tol(dtype), (s, rel(got[sl], ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
def test_flash_prefill_ragged_with_cached_prefix(dtype, head_dim, window, kv8):
    # chunks after cached prefixes, one of a single query
    check_flash_prefill(dtype, H=6, KVH=2, head_dim=head_dim, q_lens=[1, 70, 130, 64], start_pos=[0, 5, 100, 0],
                        region_starts=[0, 300, 600, 1000], layers=2, layer=0, slots=1200, window=window, kv8=kv8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [0, 200])
def test_flash_prefill_long_chunk(dtype, window):
    """Many key tiles (the double-buffered stream), a diagonal that cuts tiles, GQA 4."""
    check_flash_prefill(dtype, H=8, KVH=2, head_dim=128, q_lens=[700, 3], start_pos=[301, 40],
                        region_starts=[0, 1100], layers=1, layer=0, slots=1200, window=window)


# --------------------------------------------------------------------- sampling


V = 1500


def sampling_buffers(R, max_bias=16, max_banned=8):
    z32 = lambda: cp.zeros(R, np.float32)  # noqa: E731
    zi = lambda: cp.zeros(R, np.int32)  # noqa: E731
    return {"temperature": z32(), "top_k": zi(), "top_p": cp.ones(R, np.float32), "min_p": z32(),
            "seeds": cp.zeros(R, np.uint64), "counters": zi(), "rep_pen": cp.ones(R, np.float32),
            "freq_pen": z32(), "pres_pen": z32(), "pen_slot": cp.full(R, -1, np.int32), "bias_n": zi(),
            "banned_n": zi(), "bias_ids": cp.zeros((R, max_bias), np.int32),
            "bias_vals": cp.zeros((R, max_bias), np.float32), "banned_ids": cp.zeros((R, max_banned), np.int32)}


def gpu_sample(logits: np.ndarray, params: SamplingParams, seeds: np.ndarray, output_tokens=None,
               prompt_tokens=None, eos=()):
    from kernels_cuda.sampling import sample_tokens
    R = logits.shape[0]
    p = sampling_buffers(R)
    p["temperature"][:] = params.temperature
    p["top_k"][:] = params.top_k or 0
    p["top_p"][:] = params.top_p
    p["min_p"][:] = params.min_p
    p["seeds"][:] = cp.asarray(seeds.astype(np.uint64))
    p["counters"][:] = len(output_tokens or [])
    counts = cp.zeros((2, V), np.int32)
    mask = cp.zeros((2, (V + 31) // 32), np.uint32)
    if params.repetition_penalty != 1 or params.frequency_penalty or params.presence_penalty:
        p["rep_pen"][:] = params.repetition_penalty
        p["freq_pen"][:] = params.frequency_penalty
        p["pres_pen"][:] = params.presence_penalty
        p["pen_slot"][:] = 0
        counts[0] = cp.asarray(np.bincount(output_tokens or [], minlength=V).astype(np.int32))
        m = np.zeros((V + 31) // 32, np.uint32)
        for t in set(prompt_tokens or []):
            m[t >> 5] |= np.uint32(1 << (t & 31))
        mask[0] = cp.asarray(m)
    if params.logit_bias:
        ids = list(params.logit_bias)
        p["bias_n"][:] = len(ids)
        p["bias_ids"][:, :len(ids)] = cp.asarray(np.array(ids, np.int32))
        p["bias_vals"][:, :len(ids)] = cp.asarray(np.array(list(params.logit_bias.values()), np.float32))
    if params.min_tokens and len(output_tokens or []) < params.min_tokens:
        banned = list(params.stop_token_ids) + list(eos)
        p["banned_n"][:] = len(banned)
        p["banned_ids"][:, :len(banned)] = cp.asarray(np.array(banned, np.int32))
    out = cp.zeros(R, np.int32)
    sample_tokens(cp.asarray(logits), cp.zeros_like(cp.asarray(logits)), p, counts, mask, out)
    return cp.asnumpy(out)


def cpu_sample(logits, params, seeds, output_tokens=None, prompt_tokens=None, eos=()):
    rows = [ScheduledSeq(i, [1], 5, 0, True, params, output_token_ids=list(output_tokens or []),
                         prompt_token_ids=list(prompt_tokens or []), rng_seed=int(seeds[i]))
            for i in range(len(logits))]
    res = sample_rows(SchedulerOutput(rows), logits, eos_token_ids=tuple(eos))
    return np.array([res.sampled[i] for i in range(len(logits))])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.0, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.7, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02),
], ids=["greedy", "temp", "topk", "topp", "minp", "all"])
def test_sampling_matches_the_numpy_sampler(params):
    logits = (rng.standard_normal((400, V)) * 3).astype(np.float32)
    seeds = rng.integers(0, 2**63, 400)
    gpu = gpu_sample(logits, params, seeds)
    cpu = cpu_sample(logits, params, seeds)
    # same uniforms, same rules; float32 vs float64 may move a draw at a boundary, rarely
    assert (gpu == cpu).mean() >= 0.99


def test_penalties_bias_and_bans_match_numpy():
    logits = (rng.standard_normal((50, V)) * 3).astype(np.float32)
    seeds = rng.integers(0, 2**63, 50)
    out_tokens = [int(i) for i in np.argsort(-logits[0])[:3]] * 2
    prompt = [int(i) for i in np.argsort(-logits[0])[3:6]]
    for params in [SamplingParams(temperature=0, repetition_penalty=1.8, prompt_logprobs=None),
                   SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
                   SamplingParams(temperature=0, logit_bias={5: 50.0, 9: -100.0}),
                   SamplingParams(temperature=0, min_tokens=10, stop_token_ids=(int(np.argmax(logits[1])),))]:
        kw = dict(output_tokens=out_tokens, prompt_tokens=prompt, eos=(int(np.argmax(logits[2])),))
        np.testing.assert_array_equal(gpu_sample(logits, params, seeds, **kw), cpu_sample(logits, params, seeds, **kw))


def test_token_logprobs():
    from kernels_cuda.sampling import token_logprobs
    logits = (rng.standard_normal((9, V)) * 4).astype(np.float32)
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie: lower id first
    targets = rng.integers(0, V, 9).astype(np.int32)
    lp_n = np.array([5, 0, 20, 3, -1, 1, 2, 7, 20], np.int32)
    out_lp, out_rank = cp.zeros(9, np.float32), cp.zeros(9, np.int32)
    top_ids, top_lp = cp.zeros((9, 20), np.int32), cp.zeros((9, 20), np.float32)
    token_logprobs(cp.asarray(logits), cp.asarray(lp_n), cp.asarray(targets), out_lp, out_rank, top_ids, top_lp)
    ref = log_softmax(logits.astype(np.float64))
    got_lp, got_rank, got_ids, got_top = (cp.asnumpy(a) for a in (out_lp, out_rank, top_ids, top_lp))
    for r in range(9):
        if lp_n[r] < 0:
            continue
        assert got_lp[r] == pytest.approx(ref[r, targets[r]], abs=1e-4)
        assert got_rank[r] == 1 + int((logits[r] > logits[r, targets[r]]).sum())
        order = np.lexsort((np.arange(V), -logits[r]))[:lp_n[r]]
        np.testing.assert_array_equal(got_ids[r, :lp_n[r]], order)
        np.testing.assert_allclose(got_top[r, :lp_n[r]], ref[r, order], atol=1e-4)

