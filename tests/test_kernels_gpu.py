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


def assert_e4m3_of(codes: np.ndarray, ref: np.ndarray, noise: float = 1e-6) -> None:
    """codes hold ref rounded to e4m3: within half a step of 3 mantissa bits (plus noise, how far
    ref itself may be from the kernel's unrounded value), saturated at 448."""
    got = E4M3[codes]
    step = np.maximum(np.abs(ref), 2.0 ** -6) * 2.0 ** -3
    np.testing.assert_array_less(np.abs(got - np.clip(ref, -448, 448)), 0.5 * step + noise)


@pytest.mark.parametrize("dtype", DTYPES)
def test_e4m3_codes_widen_to_their_16_bit_values(dtype):
    """common.cuh's e4m3 -> 16-bit conversions (the fp8 K/V tiles, fp8 weights in the skinny
    GEMM) give every code's value exactly, signed zeros included."""
    from kernels_cuda._module import KERNEL_DIR
    src = ('#include "common.cuh"\n'
           'extern "C" __global__ void widen(const unsigned *w, unsigned *four, unsigned *two, int n) {\n'
           '    const int i = blockIdx.x * blockDim.x + threadIdx.x;\n'
           '    if (i >= n) return;\n'
           '    fp8x4_to_scalar2x2(w[i], four[2 * i], four[2 * i + 1]);\n'
           '    two[2 * i] = fp8x2_to_scalar2((unsigned short)(w[i] & 0xffff));\n'
           '    two[2 * i + 1] = fp8x2_to_scalar2((unsigned short)(w[i] >> 16));\n'
           '}\n')
    mod = cp.RawModule(code=src, options=("-std=c++17", f"-I{KERNEL_DIR}", f"-DUSE_BF16={int(dtype == 'bfloat16')}"))
    codes = cp.asarray(np.arange(256, dtype=np.uint8))
    four, two = cp.zeros(128, np.uint32), cp.zeros(128, np.uint32)
    mod.get_function("widen")((1,), (64,), (codes.view(np.uint32), four, two, np.int32(64)))
    got = cp.asnumpy(four).view(np.uint16)
    np.testing.assert_array_equal(got, cp.asnumpy(two).view(np.uint16))
    finite = ~np.isnan(E4M3)
    if dtype == "bfloat16":
        want = f32_to_bf16_bits(E4M3)
    else:
        want = E4M3.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert got[0x80] == 0x8000 and got[0] == 0  # -0 and +0


rng = np.random.default_rng(0)


def attend_f64(kv: np.ndarray, b: int, n: int, window: int, kv_head: int, q: np.ndarray, scale: float) -> np.ndarray:
    """softmax(k q * scale) v in float64 for one query head of row b over its first n keys
    (the last `window` of them if given) of KV head kv_head; kv (2, rows, keys, kv_heads, D)."""
    first = max(0, n - window) if window else 0
    k, v = (kv[i, b, first:n, kv_head].astype(np.float64) for i in range(2))
    s = k @ q.astype(np.float64) * scale
    p = np.exp(s - s.max())
    return p @ v / p.sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding(dtype):
    from kernels_cuda.embedding import embedding
    table = rng.standard_normal((111, 40)).astype(np.float32)
    ids = rng.integers(0, 111, 13).astype(np.int32)
    out = embedding(cp.asarray(ids), to_dev(table, dtype))
    np.testing.assert_array_equal(cp.asnumpy(out), rounded(table, dtype)[ids])
    # tokens a step before sampled, taken from the device where src >= 0
    sampled = rng.integers(0, 111, 5).astype(np.int32)
    src = np.full(13, -1, np.int32)
    src[[0, 4, 12]] = [3, 0, 3]
    out = embedding(cp.asarray(ids), to_dev(table, dtype), src=cp.asarray(src), sampled=cp.asarray(sampled))
    expect = np.where(src >= 0, sampled[np.maximum(src, 0)], ids)
    np.testing.assert_array_equal(cp.asnumpy(out), rounded(table, dtype)[expect])
    # into a 16-bit residual stream: the table's rows as they are
    table16 = to_dev(table, dtype)
    out = embedding(cp.asarray(ids), table16, out=cp.zeros((13, 40), table16.dtype))
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(table16)[ids])
    # rows of more values than a block's threads hold before the wait (embedding.cu's HELD)
    wide = rng.standard_normal((7, 8200)).astype(np.float32)
    out = embedding(cp.asarray(ids % 7), to_dev(wide, dtype))
    np.testing.assert_array_equal(cp.asnumpy(out), rounded(wide, dtype)[ids % 7])


def test_embedding_reads_ids_from_a_mapped_host_side():
    """A decode graph's embedding reads its ids and sources from the host side in place
    (StagedInputs.mapped, the side stage_in copies): each side's own values, as written after
    the views were made, and a token the step before sampled where the source says so."""
    from engine.runner.cuda_runner import StagedInputs
    from kernels_cuda.embedding import embedding
    table = to_dev(rng.standard_normal((50, 24)).astype(np.float32), "float16")
    inputs = StagedInputs({"input_ids": (np.int32, (8,)), "token_src": (np.int32, (8,))})
    sampled = cp.asarray([41, 42, 43], np.int32)
    for _ in range(2):
        h = inputs.writable()  # each side in turn
        h["input_ids"][:] = np.arange(8) + 10 * inputs.side
        h["token_src"][:] = -1
        h["token_src"][3] = 2
    for side in (0, 1):
        m = inputs.mapped[side]
        out = embedding(m["input_ids"][:5], table, src=m["token_src"][:5], sampled=sampled)
        expect = np.arange(5) + 10 * side
        expect[3] = 43
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(table).astype(np.float32)[expect])


@pytest.mark.parametrize("nbytes", [16, 4096 + 48, 1 << 20])
def test_stage_in_reads_mapped_host_memory(nbytes):
    """stage_in copies a prefix of mapped pinned host memory into a device buffer (more words
    than its grid's threads at 1 MB), leaves the rest of the buffer alone, and refuses sizes that
    are not whole 16-byte words or exceed the buffer."""
    from kernels_cuda.embedding import stage_in
    mem = cp.cuda.PinnedMemory(nbytes, cp.cuda.runtime.hostAllocMapped)
    host = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.uint8, nbytes)
    host[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = cp.full(nbytes + 64, 7, np.uint8)
    stage_in(host.ctypes.data, dst, nbytes)
    got = cp.asnumpy(dst)
    np.testing.assert_array_equal(got[:nbytes], host)
    assert (got[nbytes:] == 7).all()
    for bad in (nbytes + 8, nbytes + 128, 0):
        with pytest.raises(ValueError):
            stage_in(host.ctypes.data, dst, bad)


@pytest.mark.parametrize("V", [3001, 3000, 49152, 128256])  # odd and even rows; SmolLM2's; Llama-3's
def test_greedy_sampling_takes_the_first_largest_logit(V):
    """A greedy row's token is the first index of its largest logit (NaN never wins, a row of
    -inf gives 0); ties planted within one thread's values, across threads, and at the last value."""
    from kernels_cuda.sampling import plain_params, sample_tokens
    R = 6
    x = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    top = x.max() + 1
    x[1, [V - 1, V // 2, 7]] = top  # ties: the lowest index wins
    x[2, [5, (4 * 1024 * 8 + 3) % V]] = top  # a tie across threads
    x[3, :] = -np.inf
    x[4, ::97] = np.nan
    x[5, V - 1] = top  # the last value
    sampled = cp.full(R, -1, cp.int32)
    sample_tokens(cp.asarray(x), cp.empty((R, V), cp.float32), plain_params([0.0] * R), cp.zeros((1, V), cp.int32),
                  cp.zeros((1, (V + 31) // 32), cp.uint32), sampled)
    want = np.nanargmax(np.where(np.isnan(x), -np.inf, x), axis=1)
    np.testing.assert_array_equal(cp.asnumpy(sampled), want)
    assert want[1] == 7 and want[3] == 0 and want[5] == V - 1


def first_argmax(x: np.ndarray) -> np.ndarray:
    """A row's greedy token: the first index of its largest logit, NaN never; 0 where none is a number."""
    return np.nanargmax(np.where(np.isnan(x), -np.inf, x), axis=1)


def greedy_of_keys(logits: cp.ndarray, keys: tuple | None, params: dict | None = None) -> np.ndarray:
    """sample_tokens' tokens for these logits (greedy rows unless params say otherwise), with the keys."""
    from kernels_cuda.sampling import plain_params, sample_tokens
    R, V = logits.shape
    sampled = cp.full(R, -1, cp.int32)
    sample_tokens(logits, cp.empty((R, V), cp.float32), params or plain_params([0.0] * R),
                  cp.zeros((1, V), cp.int32), cp.zeros((1, (V + 31) // 32), cp.uint32), sampled, keys=keys)
    return cp.asnumpy(sampled)


@pytest.mark.parametrize("form", ["w16", "fp8", "q8_0"])
@pytest.mark.parametrize("N", [3001, 49152])
def test_gemv_keys_give_the_greedy_token(form, N):
    """gemv_keys: gemv's logits to the bit, and a key a tile a row whose max is the row's first
    largest logit, at 1-16 rows (one and two tiles a block; 16-bit, e4m3 and Q8_0 heads, Q8_0 at up
    to 4 rows looping over its tiles); sample_tokens over those keys gives the tokens it gives over
    the logits."""
    from kernels_cuda.gemv import gemv, gemv_keys
    from kernels_cuda.quant import Q8Matrix, quantize_matrix
    r = np.random.default_rng(21)
    K = 96
    if form == "q8_0":
        codes, scales, _ = random_q8_0(N, K, r)
        w = Q8Matrix(cp.asarray(codes), cp.asarray(scales))
    else:
        w = to_dev(r.standard_normal((N, K)).astype(np.float32), "float16")
        w = quantize_matrix(w) if form == "fp8" else w
    x = to_dev(r.standard_normal((16, K)).astype(np.float32), "float16")
    for B in (1, 3, 8, 9, 16):
        want = cp.asnumpy(gemv(x[:B], w))
        logits = cp.zeros((B, N), cp.float32)
        keys = cp.zeros((B, -(-N // 8) + 3), cp.uint64)
        count = gemv_keys(x[:B], w, logits, keys)
        np.testing.assert_array_equal(cp.asnumpy(logits), want)
        assert count in (-(-N // 8), -(-N // 16))
        assert not cp.asnumpy(keys)[:, count:].any()  # past the count: as they were
        np.testing.assert_array_equal(greedy_of_keys(logits, (keys, count)), first_argmax(want))
        np.testing.assert_array_equal(greedy_of_keys(logits, None), first_argmax(want))


def test_greedy_keys_of_ties_nan_and_inf():
    """A logit's key orders as argmax_pair does: ties to the lower token within a tile, across tiles
    and at the last token; NaN never, even against -inf (a row of NaNs only gives 0, as does the
    logits' own argmax); a row of -inf gives 0. Each row planted in weight column 0 of its own
    one-row product."""
    from kernels_cuda.gemv import gemv_keys
    V, K = 3001, 64
    r = np.random.default_rng(5)
    base = (r.standard_normal(V) * 3).astype(np.float16).astype(np.float32)
    top = np.float32(np.float16(base.max() + 1))
    rows = [base.copy() for _ in range(7)]
    rows[0][[V - 1, V // 2, 7]] = top  # ties across tiles: the lowest wins
    rows[1][[5, 6]] = top  # a tie within a tile
    rows[2][:] = -np.inf
    rows[3][::97] = np.nan
    rows[4][:] = np.nan
    rows[5][V - 1] = top  # the last token
    rows[6][::2] = np.nan
    rows[6][1::2] = -np.inf
    x = cp.asarray(np.eye(1, K, dtype=np.float16))
    for i, col in enumerate(rows):
        w = np.zeros((V, K), np.float16)
        w[:, 0] = col
        logits, keys = cp.zeros((1, V), cp.float32), cp.zeros((1, -(-V // 8)), cp.uint64)
        count = gemv_keys(x, cp.asarray(w), logits, keys)
        got = cp.asnumpy(logits)[0]
        np.testing.assert_array_equal(got, col)
        numbers = ~np.isnan(got)  # the first of the largest that is a number (-inf too), else 0
        want = int(np.flatnonzero(numbers & (got == got[numbers].max()))[0]) if numbers.any() else 0
        assert want == {0: 7, 1: 5, 2: 0, 4: 0, 5: V - 1, 6: 1}.get(i, want), i  # row 6: -inf at 1, NaN at 0
        assert greedy_of_keys(logits, (keys, count))[0] == want, i
        assert greedy_of_keys(logits, None)[0] == want, i


def test_sampling_reads_the_keys_of_plain_greedy_rows_only():
    """sample_tokens takes a plain greedy row's token from its keys, and a row with a bias, a ban
    or penalties, or a temperature, from its logits: keys planted to name token 5 (not the logits'
    argmax) show which each row read."""
    from kernels_cuda.sampling import plain_params
    R, V = 5, 3001
    x = np.zeros((R, V), np.float32)
    x[:, 100] = 10.0
    keys = np.zeros((R, 4), np.uint64)
    keys[:, 2] = (np.uint64(0xFFFFFFFF) << np.uint64(32)) | np.uint64(0xFFFFFFFF - 5)  # the largest: token 5
    p = plain_params([0.0, 0.0, 0.0, 0.0, 1e-4])
    p["bias_n"][1] = 1  # +20 on token 200
    p["bias_ids"][1, 0] = 200
    p["bias_vals"][1, 0] = 20.0
    p["banned_n"][2] = 1  # token 100 banned: 0 is the first of the rest
    p["banned_ids"][2, 0] = 100
    p["pen_slot"][3] = 0  # penalties (none that move anything): the row is processed
    got = greedy_of_keys(cp.asarray(x), (cp.asarray(keys), 4), p)
    np.testing.assert_array_equal(got, [5, 200, 0, 100, 100])


def kept_probs(x: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """The probabilities after temperature and top-k (ties with the k-th largest stay), float64."""
    s = x.astype(np.float64) / temperature
    keep = s >= np.sort(s)[-top_k] if top_k else np.ones(s.size, bool)
    p = np.where(keep, np.exp(s - s.max()), 0.0)
    return p / p.sum()


@pytest.mark.parametrize("V", [3001, 49152])
def test_top_k_and_top_p_draw_only_from_what_they_keep(V):
    """Sampled rows (temperature, top-k, top-p, both) draw only tokens their filters keep (ties
    with the k-th largest logit included), and more than one of them over 512 draws: the
    thresholds the kernel finds are the filters' own. top_p sits halfway between the masses of
    the n - 1 and n most likely tokens, so the nucleus is those n."""
    from kernels_cuda.sampling import plain_params, sample_tokens
    R, temp = 128, 0.8
    r = np.random.default_rng(5)
    x = (r.standard_normal(V) * 0.5).astype(np.float32)
    head = r.permutation(V)[:12]
    x[head] = (8.0 + 0.25 * np.arange(12)).astype(np.float32)
    x[head[6]] = x[head[7]]  # a tie at the 5th largest: top-k 5 keeps 6 tokens
    logits = cp.asarray(np.tile(x, (R, 1)))
    for k, n in [(5, None), (0, 4), (8, 3), (0, 7)]:  # top-k, tokens the nucleus holds (None: top_p 1)
        p = kept_probs(x, temp, k)
        tp, want = 1.0, set(np.flatnonzero(p))
        if n is not None:
            cum = np.cumsum(np.sort(p)[::-1])
            tp = float((cum[n - 2] + cum[n - 1]) / 2)
            want = set(np.argsort(-p, kind="stable")[:n])
        assert len(want) == (6 if k == 5 else n)
        params = plain_params([temp] * R, top_k=k, top_p=tp)
        drawn = []
        for start in range(0, 4 * R, R):
            params["counters"] = cp.arange(start, start + R, dtype=cp.int32)
            sampled = cp.full(R, -1, cp.int32)
            sample_tokens(logits, cp.empty_like(logits), params, cp.zeros((1, V), cp.int32),
                          cp.zeros((1, (V + 31) // 32), cp.uint32), sampled)
            drawn += cp.asnumpy(sampled).tolist()
        assert set(drawn) <= want, (k, tp, sorted(set(drawn) - want))
        assert len(set(drawn)) >= 3, (k, tp, set(drawn))


# (top_k, top_p, min_p) of the rows below: filters that keep few tokens, two that keep more than
# sample_few holds (top-k 5,000; top-p 0.999 over flat logits), and none (sample_all's rows)
FEW_FILTERS = [(0, 1.0, 0.0), (50, 1.0, 0.0), (1, 1.0, 0.0), (0, 0.9, 0.0), (0, 0.5, 0.0), (40, 0.9, 0.0), (0, 1.0, 0.05),
               (0, 0.95, 0.02), (5000, 1.0, 0.0), (0, 0.999, 0.0), (20, 0.8, 0.1)]


def few_rows(V: int, r: np.random.Generator) -> tuple[np.ndarray, list]:
    """Logit rows of five shapes (peaked, flat, so wide that a low temperature puts top-k's k-th
    token past sample_few's 64 nats, many ties, a tenth of -inf) under every FEW_FILTERS at two
    temperatures: (rows (R, V) float32, [(temperature, top_k, top_p, min_p, shape)] a row)."""
    shapes = {"peaked": r.standard_normal(V) * 3, "flat": r.standard_normal(V) * 0.3,
              "wide": r.standard_normal(V) * 40, "ties": np.round(r.standard_normal(V) * 4) / 2,
              "banned": np.where(r.random(V) < 0.1, -np.inf, r.standard_normal(V) * 2)}
    rows, cases = [], []
    for name, x in shapes.items():
        for temp in (0.5, 1.0):
            for k, tp, mp in FEW_FILTERS:
                rows.append(x.astype(np.float32))
                cases.append((temp, k, tp, mp, name))
    return np.stack(rows), cases


@pytest.mark.parametrize("V", [3001, 49152, 128256])
def test_sample_few_gives_the_bisections_tokens_and_numpys(V):
    """sample_few (thresholds from the few tokens that can pass them) and sample_all (rows with a
    temperature alone, and top-p rows whose threshold's bins sample_few holds but not all of its
    nucleus) draw the same token as the bisection over the whole row (few_cap=0) and as the NumPy
    runner's allowed_probs + draw, for top-k, top-p, min-p, their mixes and no filter, over
    peaked, flat, wide, tied and partly -inf rows, four draws each; where more than FEW_CAP
    tokens are kept, float32 sums in other orders may move a draw at a boundary now and then.
    sample_few takes the rows whose filters keep few tokens and the top-p rows above; it leaves
    to the bisection top-k rows that keep more than it holds."""
    from engine.runner.sampling import allowed_probs, draw, seeded_uniform
    from kernels_cuda.sampling import FEW_CAP, plain_params, sample_tokens
    x, cases = few_rows(V, np.random.default_rng(V))
    R = len(cases)
    logits = cp.asarray(x)
    params = plain_params([c[0] for c in cases])
    params["top_k"] = cp.asarray(np.array([c[1] for c in cases], np.int32))
    params["top_p"] = cp.asarray(np.array([c[2] for c in cases], np.float32))
    params["min_p"] = cp.asarray(np.array([c[3] for c in cases], np.float32))
    counts, mask = cp.zeros((1, V), cp.int32), cp.zeros((1, (V + 31) // 32), cp.uint32)
    seeds = cp.asnumpy(params["seeds"])
    kept = [np.count_nonzero(allowed_probs(x[i], c[0], c[1] or None, c[2], c[3])) for i, c in enumerate(cases)]
    many = [i for i in range(R) if kept[i] > FEW_CAP]
    off = {"bisection": [], "numpy": []}
    for counter in (0, 1, 7, 1000):
        params["counters"] = cp.full(R, counter, cp.int32)
        got, bisected, used = cp.full(R, -1, cp.int32), cp.full(R, -1, cp.int32), cp.full(R, -1, cp.int32)
        sample_tokens(logits, cp.empty_like(logits), params, counts, mask, got, few_used=used)
        sample_tokens(logits, cp.empty_like(logits), params, counts, mask, bisected, few_cap=0)
        got, bisected, used = cp.asnumpy(got), cp.asnumpy(bisected), cp.asnumpy(used)
        for i, (temp, k, tp, mp, name) in enumerate(cases):
            probs = allowed_probs(x[i], temp, k or None, tp, mp)
            assert probs[got[i]] > 0, (cases[i], counter)
            if got[i] != bisected[i]:
                off["bisection"].append((i, counter, cases[i], kept[i]))
            if draw(probs, seeded_uniform(int(seeds[i]), counter)) != got[i]:
                off["numpy"].append((i, counter, cases[i], kept[i]))
            if kept[i] <= 256 and name != "wide":
                assert used[i] == 1, (cases[i], kept[i])
            if 0 < k < V and kept[i] > FEW_CAP:
                assert used[i] == 0, (cases[i], kept[i])
            if k == 0 and tp < 1 and mp == 0 and name in ("peaked", "banned") and kept[i] > FEW_CAP:
                assert used[i] == 1, (cases[i], kept[i])  # the nucleus drawn over the row
            assert used[i] in (0, 1)
        assert used.sum() >= R // 2, used
    for peer, rows in off.items():
        assert all(i in many for i, *_ in rows), (peer, [r for r in rows if r[0] not in many])
        assert len(rows) <= max(2, 4 * len(many) // 20), (peer, rows)


def test_sampled_rows_with_no_finite_logit_give_0():
    """A sampled row of -inf or of NaN gives token 0 (as a greedy one does), whatever its filters;
    the rows beside it keep their own tokens."""
    from kernels_cuda.sampling import plain_params, sample_tokens
    V = 49152
    filters = [(0, 1.0, 0.0), (0, 0.9, 0.0), (50, 1.0, 0.0), (0, 1.0, 0.1), (40, 0.9, 0.0)]
    x = np.tile(rng.standard_normal(V).astype(np.float32) * 3, (3 * len(filters), 1))
    x[0::3] = -np.inf
    x[1::3] = np.nan
    params = plain_params([0.8] * x.shape[0])
    params["top_k"] = cp.asarray(np.repeat([f[0] for f in filters], 3).astype(np.int32))
    params["top_p"] = cp.asarray(np.repeat([f[1] for f in filters], 3).astype(np.float32))
    params["min_p"] = cp.asarray(np.repeat([f[2] for f in filters], 3).astype(np.float32))
    for few_cap in (4096, 0):
        sampled = cp.full(x.shape[0], -1, cp.int32)
        sample_tokens(cp.asarray(x), cp.empty(x.shape, cp.float32), params, cp.zeros((1, V), cp.int32),
                      cp.zeros((1, (V + 31) // 32), cp.uint32), sampled, few_cap=few_cap)
        got = cp.asnumpy(sampled)
        np.testing.assert_array_equal(got[0::3], 0)
        np.testing.assert_array_equal(got[1::3], 0)
        assert (got[2::3] > 0).all() and len(set(got[2::3])) > 1, got[2::3]


def test_sampling_writes_the_host_and_logprobs_of_its_tokens():
    """sample_tokens with host_out and logprobs: each row's token also lands in pinned host
    memory at its out_index, and its logprobs are token_logprobs' (same bits) for that token."""
    from kernels_cuda.sampling import plain_params, sample_tokens, token_logprobs
    R, V, top = 5, 3000, 4
    logits = cp.asarray(rng.standard_normal((R, V)).astype(np.float32) * 3)
    params = plain_params([0, 0, 0.8, 0, 1.0])
    lp_n = params["lp_n"] = cp.asarray(np.array([2, -1, 0, 3, -1], np.int32))
    params["out_index"] = params["out_index"] + R
    mem = cp.cuda.PinnedMemory(2 * R * 4, cp.cuda.runtime.hostAllocMapped)
    host = np.frombuffer(cp.cuda.PinnedMemoryPointer(mem, 0), np.int32, 2 * R)
    host[:] = -7
    outs = [cp.full(R, np.nan, cp.float32), cp.full(R, -1, cp.int32), cp.full((R, top), -1, cp.int32),
            cp.full((R, top), np.nan, cp.float32)]
    sampled = cp.full(R, -1, cp.int32)
    sample_tokens(logits, cp.empty_like(logits), params, cp.zeros((1, V), cp.int32),
                  cp.zeros((1, (V + 31) // 32), cp.uint32), sampled, host_out=host, logprobs=tuple(outs))
    cp.cuda.Device().synchronize()
    tokens = cp.asnumpy(sampled)
    np.testing.assert_array_equal(host[R:], tokens)
    np.testing.assert_array_equal(host[:R], -7)  # the other set untouched
    greedy = cp.asnumpy(params["temperature"]) == 0
    np.testing.assert_array_equal(tokens[greedy], cp.asnumpy(logits).argmax(axis=1)[greedy])
    ref = [cp.full(R, np.nan, cp.float32), cp.full(R, -1, cp.int32), cp.full((R, top), -1, cp.int32),
           cp.full((R, top), np.nan, cp.float32)]
    token_logprobs(logits, lp_n, sampled, *ref)
    asked = cp.asnumpy(lp_n) >= 0
    for got, want in zip(outs, ref):
        np.testing.assert_array_equal(cp.asnumpy(got)[asked], cp.asnumpy(want)[asked])
    np.testing.assert_array_equal(cp.asnumpy(outs[1])[~asked], -1)  # rows that asked for none: nothing written
    lsm = log_softmax(cp.asnumpy(logits).astype(np.float64))
    np.testing.assert_allclose(cp.asnumpy(outs[0])[asked], lsm[np.arange(R), tokens][asked], atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1000, 1002, 9000])  # in registers; not a multiple of 4; longer than they hold
@pytest.mark.parametrize("rows", [7, 600, 1100])  # 600: a step of many rows (rmsnorm.WIDE_MIN_ROWS: smaller blocks); 1100: loads ahead
def test_rms_norm_and_fused_add(dtype, hidden, rows):
    from kernels_cuda.rmsnorm import add_rms_norm, rms_norm
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    d = rng.standard_normal((rows, hidden)).astype(np.float32)
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
@pytest.mark.parametrize("hidden", [1000, 1002, 4104])  # float4 in registers; the plain loop only; five a thread
@pytest.mark.parametrize("rows", [7, 1100])  # one group a thread; smaller blocks with the loads ahead
@pytest.mark.parametrize("fp8", [False, True], ids=["", "fp8"])  # a float8 product's bfloat16 delta, codes out
def test_residual_stream_in_16_bits(dtype, hidden, rows, fp8):
    """A 16-bit residual stream (the runner's steps of many rows in bfloat16 models) holds the
    float32 sums rounded to 16 bits, and the norm is of those rounded values: the bits of the
    float32 kernels run on the same values, rounded between them."""
    from kernels_cuda.rmsnorm import add_rms_norm, rms_norm
    x = rng.standard_normal((rows, hidden)).astype(np.float32) * 4
    d = to_dev(rng.standard_normal((rows, hidden)).astype(np.float32) * 50, "bfloat16") if fp8 else \
        cp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32))
    w = cp.asarray(rng.standard_normal(hidden).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(hidden).astype(np.float32))
    scales = (cp.asarray(rng.random(rows).astype(np.float32)), cp.asarray(rng.random(hidden).astype(np.float32)))
    odt = np.uint16 if dtype == "bfloat16" else np.float16
    quant = fp8 and hidden % 8 == 0

    def codes():
        return (cp.zeros((rows, hidden), np.uint8), cp.zeros(rows, np.float32)) if quant else None

    res16 = to_dev(x, dtype)
    res32 = cp.asarray(from_dev(res16))
    q16, q32 = codes(), codes()
    out16 = add_rms_norm(res16, d, w, 1e-5, bias=bias, out_dtype=odt, scales=scales if fp8 else None, quant=q16)
    add_rms_norm(res32, d, w, 1e-5, bias=bias, out_dtype=odt, scales=scales if fp8 else None)
    np.testing.assert_array_equal(from_dev(res16), rounded(cp.asnumpy(res32), dtype))
    out32 = rms_norm(cp.asarray(from_dev(res16)), w, 1e-5, out_dtype=odt, quant=q32)
    np.testing.assert_array_equal(cp.asnumpy(out16), cp.asnumpy(out32))
    # rms_norm of a 16-bit stream: its values' bits
    again = rms_norm(res16, w, 1e-5, out_dtype=odt, quant=codes())
    np.testing.assert_array_equal(cp.asnumpy(again), cp.asnumpy(out32))
    if quant:
        for a, b in zip(q16, q32):
            np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
    assert cp.asnumpy(out16).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1002, 4104])  # the plain loop only; five float4 a thread
@pytest.mark.parametrize("fp8", [False, True], ids=["delta32", "fp8"])  # a float8 product's delta, codes out
@pytest.mark.parametrize("delta16", [False, True], ids=["", "bf16"])  # the delta in bfloat16 (the runner's many rows)
def test_add_rms_norm_loads_ahead_same_bits(dtype, hidden, fp8, delta16, monkeypatch):
    """Steps of rmsnorm.AHEAD_MIN_ROWS rows or more issue a thread's loads at once (-DNORM_AHEAD):
    the same arithmetic, so the same bits as with the loads issued in turn. A delta written in
    bfloat16 gives the bits of its values in float32."""
    from kernels_cuda import rmsnorm
    rows = rmsnorm.AHEAD_MIN_ROWS + 3
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    d = cp.asarray(rng.standard_normal((rows, hidden)).astype(np.float32) * 50)
    if delta16:
        d16 = to_dev(cp.asnumpy(d), "bfloat16")
        d = cp.asarray(from_dev(d16))
    w = cp.asarray(rng.standard_normal(hidden).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(hidden).astype(np.float32))
    scales = (cp.asarray(rng.random(rows).astype(np.float32)), cp.asarray(rng.random(hidden).astype(np.float32)))
    odt = np.uint16 if dtype == "bfloat16" else np.float16
    results = []
    for ahead_min in (rows + 1, rows):  # in turn, then ahead
        monkeypatch.setattr(rmsnorm, "AHEAD_MIN_ROWS", ahead_min)
        assert rmsnorm._shape(rows, hidden)[2] == int(ahead_min == rows)
        res = cp.asarray(x)
        quant = (cp.zeros((rows, hidden), np.uint8), cp.zeros(rows, np.float32)) if fp8 and hidden % 8 == 0 else None
        out = rmsnorm.add_rms_norm(res, d, w, 1e-5, bias=bias, out_dtype=odt, scales=scales if fp8 else None,
                                   quant=quant)
        results.append([cp.asnumpy(a) for a in (res, out, *(quant or ()))])
        if delta16:
            res = cp.asarray(x)
            quant16 = tuple(cp.zeros_like(a) for a in quant) if quant else None
            out = rmsnorm.add_rms_norm(res, d16, w, 1e-5, bias=bias, out_dtype=odt, scales=scales if fp8 else None,
                                       quant=quant16)
            results.append([cp.asnumpy(a) for a in (res, out, *(quant16 or ()))])
    assert results[0][1].any()
    for got in results[1:]:
        for a, b in zip(results[0], got):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
# threads a row, values a row: four chunks of 8 a thread, four warps (the runner's 8B rows); one, four
# warps; two and two; one and one (no barrier)
@pytest.mark.parametrize("row_threads,hidden", [(128, 4096), (128, 1024), (64, 1024), (32, 256)])
@pytest.mark.parametrize("delta", ["f32", "f16", "bf16", "fp8"])  # fp8: a float8 product's raw sums and scales
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_add_rms_norm_rows(dtype, row_threads, hidden, delta, with_bias, monkeypatch):
    """A 16-bit residual stream in steps of rmsnorm.ROWS_MIN_ROWS rows or more takes
    add_rms_norm_rows (a group of threads a row, two rows a block): the residual holds the float32
    sums rounded to 16 bits (the same value, or the next one where a multiply and an add fuse
    otherwise), the output is the norm of those rounded values within a unit in its last place,
    and the codes and scales are quantize_rows' of that output."""
    from kernels_cuda import rmsnorm
    from kernels_cuda.quant import quantize_rows
    monkeypatch.setattr(rmsnorm, "ROW_THREADS", row_threads)
    rows = rmsnorm.ROWS_MIN_ROWS + 3  # the last block holds one row
    assert rmsnorm.rows_kernel(rows, hidden, 1, 1) and not rmsnorm.rows_kernel(rows, hidden, 0, 1)
    x = rng.standard_normal((rows, hidden)).astype(np.float32) * 4
    d32 = rng.standard_normal((rows, hidden)).astype(np.float32) * (50 if delta == "fp8" else 1)
    d = {"f32": lambda: cp.asarray(d32), "f16": lambda: cp.asarray(d32.astype(np.float16))}.get(
        delta, lambda: to_dev(d32, "bfloat16"))()
    dv = from_dev(d) if delta != "f32" else d32  # the delta's values
    rs, cs = rng.random(rows).astype(np.float32), rng.random(hidden).astype(np.float32)
    w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    bias = rng.standard_normal(hidden).astype(np.float32) if with_bias else np.zeros(hidden, np.float32)
    odt = np.uint16 if dtype == "bfloat16" else np.float16
    res = to_dev(x, dtype)
    xr = from_dev(res)
    out = cp.zeros((rows, hidden), odt)
    q, qs = cp.zeros((rows, hidden), np.uint8), cp.zeros(rows, np.float32)
    rmsnorm.add_rms_norm(res, d, cp.asarray(w), 1e-5, out=out, bias=cp.asarray(bias) if with_bias else None,
                         scales=(cp.asarray(rs), cp.asarray(cs)) if delta == "fp8" else None, quant=(q, qs))
    e = dv * rs[:, None] * cs[None, :] if delta == "fp8" else dv
    want = rounded(xr + e + bias, dtype)
    got = from_dev(res)
    unit = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10
    np.testing.assert_allclose(got, want, rtol=unit, atol=1e-6)
    assert (got == want).mean() > 0.99
    g64 = got.astype(np.float64)
    ref = g64 / np.sqrt(np.mean(g64 * g64, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(from_dev(out), ref, rtol=unit, atol=1e-6)
    ref_q, ref_s = quantize_rows(out)
    np.testing.assert_array_equal(cp.asnumpy(q), cp.asnumpy(ref_q))
    np.testing.assert_array_equal(cp.asnumpy(qs), cp.asnumpy(ref_s))
    # codes only: the same codes, out untouched
    res2 = to_dev(x, dtype)
    untouched = cp.full((rows, hidden), 0x1234, np.uint16).view(odt)
    q2, qs2 = cp.zeros_like(q), cp.zeros_like(qs)
    rmsnorm.add_rms_norm(res2, d, cp.asarray(w), 1e-5, out=untouched, bias=cp.asarray(bias) if with_bias else None,
                         scales=(cp.asarray(rs), cp.asarray(cs)) if delta == "fp8" else None, quant=(q2, qs2),
                         codes_only=True)
    assert (untouched.view(np.uint16) == 0x1234).all()
    np.testing.assert_array_equal(cp.asnumpy(q2), cp.asnumpy(q))
    np.testing.assert_array_equal(cp.asnumpy(res2), cp.asnumpy(res))
    if delta == "bf16" and not with_bias:
        # no delta (rms_norm of a 16-bit stream of as many rows, whose products added their output
        # in their epilogue): the norm of the stream as stored, the bits of the add's; the stream
        # left as it was
        stored = cp.asnumpy(res)
        out3, q3, qs3 = cp.zeros_like(out), cp.zeros_like(q), cp.zeros_like(qs)
        rmsnorm.rms_norm(res, cp.asarray(w), 1e-5, out=out3, quant=(q3, qs3))
        np.testing.assert_array_equal(cp.asnumpy(res), stored)
        for a, b in ((out3, out), (q3, q), (qs3, qs)):
            np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [333, 528, 20000])  # plain loop; 8 values a thread; longer than registers hold
@pytest.mark.parametrize("prod16", [False, True], ids=["prod32", "prod16"])
def test_silu_mul(dtype, inter, prod16):
    from kernels_cuda.activation import silu_mul
    gu = rng.standard_normal((5, 2 * inter)).astype(np.float32) * 4
    if prod16:  # a 16-bit product (cuBLAS's output for steps of many rows)
        gu_dev, gu = to_dev(gu, dtype), rounded(gu, dtype)
    else:
        gu_dev = cp.asarray(gu)
    g, u = gu[:, :inter], gu[:, inter:]
    out = silu_mul(gu_dev, out_dtype=np.uint16 if dtype == "bfloat16" else np.float16)
    assert rel(from_dev(out), g / (1 + np.exp(-g)) * u) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_within_its_output_rounding_everywhere(dtype):
    """SiLU * up on one hardware tanh (common.cuh's silu_times): over gates from -60 to 60, each
    value within its 16-bit rounding plus the tanh's ~2^-11 relative error on g / 2, and SiLU's
    limits at both ends (g * u far above zero, 0 far below)."""
    from kernels_cuda.activation import silu_mul
    inter = 4096
    g = np.linspace(-60, 60, inter, dtype=np.float32)
    u = rng.uniform(0.5, 2, inter).astype(np.float32)
    gu = np.concatenate([g, u])[None, :]
    got = from_dev(silu_mul(cp.asarray(gu), out_dtype=np.uint16 if dtype == "bfloat16" else np.float16))[0]
    exact = (g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64))) * u).astype(np.float32)
    ulp = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
    bound = np.abs(exact) * ulp + 2.0 ** -10 * np.abs(g / 2) * u + 1e-7
    np.testing.assert_array_less(np.abs(got - exact), bound)
    assert np.abs(got[g <= -20]).max() < 1e-5 and np.allclose(got[g >= 20], rounded(g * u, dtype)[g >= 20], rtol=ulp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab,cand", [(1, 128256, 8), (3, 49152, 8), (300, 5003, 8), (40, 1000, 1),
                                             (2, 70, 32), (5, 6, 8)])
def test_rescore_replaces_the_largest_logits_with_exact_ones(dtype, rows, vocab, cand):
    """rescore.rescore: each row's `cand` largest logits (of one split or many; a vocabulary of
    whole float4s or not; fewer logits than candidates) become x[row] . head[id] in float32, every
    other logit keeps its bits; NaN and -inf logits are never candidates."""
    from kernels_cuda.rescore import rescore, splits
    hidden = 264
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    head = rng.standard_normal((vocab, hidden)).astype(np.float32) * 0.1
    xd, hd = to_dev(x, dtype), to_dev(head, dtype)
    exact = rounded(x, dtype).astype(np.float64) @ rounded(head, dtype).astype(np.float64).T
    logits = (exact + rng.standard_normal(exact.shape) * 0.05).astype(np.float32)  # an fp8 head's error
    if vocab > 2 * cand:
        logits[0, 1] = np.nan
        logits[0, 2] = -np.inf
        logits[-1, -1] = 1e30  # a candidate at the very end of a row
    before = logits.copy()
    dev = cp.asarray(logits)
    rescore(dev, xd, hd, cand)
    got = cp.asnumpy(dev)
    for r in range(rows):
        order = np.argsort(-np.nan_to_num(before[r], nan=-np.inf), kind="stable")
        top = [i for i in order[:cand] if before[r, i] > -np.inf]  # NaN is not
        changed = np.flatnonzero(got[r].view(np.uint32) != before[r].view(np.uint32))
        assert set(changed) <= set(top)
        np.testing.assert_allclose(got[r, top], exact[r, top], rtol=1e-5, atol=1e-5)
    assert np.isnan(got[0, 1]) == (vocab > 2 * cand)
    print(f"rescore {rows} x {vocab}: {splits(rows, vocab)} slices a row")


def test_bench_lm_head_table_times_each_form():
    """bench/kernels.py --lm-head on a small head: a line per row count (the skinny GEMM's and
    cuBLAS's), each with four positive times."""
    from bench.kernels import lm_head_table
    lines = lm_head_table({"vocab_size": 5008, "hidden_size": 256}, [1, 20])  # cuBLASLt fp8: N % 16 == 0
    assert len(lines) == 3
    for line in lines[1:]:
        times = [float(t) for t in line.split(":")[1].split("|")]
        assert len(times) == 4 and all(t > 0 for t in times)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [14336, 18944, 1000])  # two blocks an SM; one; a row short of a block's threads
@pytest.mark.parametrize("quant", [False, True], ids=["out16", "codes"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "fp8sums"])
def test_silu_mul_bulk_gives_the_row_kernels_bits(dtype, inter, quant, scaled, monkeypatch):
    """Steps of many rows of a 16-bit product take silu_mul_bulk (rows into shared memory by bulk
    copies, several rows a block, each stage's barrier through several phases): the bits of the
    one-block-a-row kernel, 16-bit output and e4m3 codes and scales, raw float8 sums scaled too."""
    from kernels_cuda import activation
    from kernels_cuda._module import sm90_or_newer
    if not sm90_or_newer():
        pytest.skip("bulk copies need sm_90")
    if scaled and dtype == "float16":
        pytest.skip("float8 sums are written in bfloat16")
    T = 1100
    scalar = np.uint16 if dtype == "bfloat16" else np.float16
    gate_up = to_dev(rng.standard_normal((T, 2 * inter)).astype(np.float32) * (3000 if scaled else 3), dtype)
    gate_up[7] = 0  # a zero row: scale 1
    scales = ((cp.asarray(rng.uniform(0.001, 0.01, T).astype(np.float32)),
               cp.asarray(rng.uniform(0.001, 0.01, 2 * inter).astype(np.float32))) if scaled else None)
    prod = 2 if dtype == "bfloat16" else 1
    bulk = activation._bulk(T, inter, prod, {"USE_BF16": prod - 1, "PROD": prod, "QUANT_OUT": int(quant)})
    assert bulk is not None and bulk[1] * activation.SILU_BULK_STAGES < T  # stages refilled, phases wrapping

    def run():
        q = (cp.full((T, inter), 0x55, np.uint8), cp.zeros(T, np.float32)) if quant else None
        out = activation.silu_mul(gate_up, out_dtype=scalar, scales=scales, quant=q)
        return [out, *q] if quant else [out]

    got = run()
    monkeypatch.setattr(activation, "SILU_BULK_MIN_ROWS", 1 << 30)
    want = run()
    assert got[0].any()
    for a, b in zip(got, want):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))


def test_silu_mul_bulk_rows_of_any_length_in_one_build():
    """Rows of 512 and then of 4,096 values take the same build of silu_mul_bulk (one 8-value group
    a thread) with 4 and 32 KB of shared memory: the second launch is allowed its larger share."""
    from kernels_cuda.activation import silu_mul
    from kernels_cuda._module import sm90_or_newer
    if not sm90_or_newer():
        pytest.skip("bulk copies need sm_90")
    for inter in (512, 4096):
        x = rng.standard_normal((300, 2 * inter)).astype(np.float32)
        out = silu_mul(to_dev(x, "float16"), out_dtype=np.float16)
        g, u = rounded(x[:, :inter], "float16"), rounded(x[:, inter:], "float16")
        assert rel(from_dev(out), g / (1 + np.exp(-g)) * u) < tol("float16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [36, 64, 128])  # 36: one pair a thread at a time, else four
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("prod16", [False, True], ids=["prod32", "prod16"])
@pytest.mark.parametrize("wide", [False, True], ids=["few", "wide"])  # wide: a step of _module.WIDE_MIN_ROWS+ tokens
def test_rope_kv_write(dtype, head_dim, with_bias, kv8, prod16, wide):
    from kernels_cuda.rope import rope_kv_write
    T, H, KVH, layers = (520, 24, 8, 3) if wide else (9, 6, 2, 3)
    qkv = rng.standard_normal((T, (H + 2 * KVH) * head_dim)).astype(np.float32)
    qkv_dev = cp.asarray(qkv)
    if prod16:
        qkv_dev, qkv = to_dev(qkv, dtype), rounded(qkv, dtype)
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
    rope_kv_write(qkv_dev, cp.asarray(pos), cp.asarray(cos), cp.asarray(sin), kp, vp,
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
@pytest.mark.parametrize("heads", [(32, 8, 128), (28, 4, 128), (6, 2, 64)], ids=["items3.5", "items2.5", "items0.4"])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("prod", ["prod32", "prod16", "fp8sums"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rope_kv_write_rows_gives_the_one_block_bits(dtype, heads, kv8, prod, with_bias):
    """rope_kv_write_rows (steps of many tokens: 8-value items, all of a thread's loads first)
    writes the bits of the one-block-a-token form: q, and k / v in the cache, other slots untouched."""
    from kernels_cuda.rope import ROWS_MIN_ROWS, ROWS_THREADS, rope_kv_write, rows_items
    H, KVH, D = heads
    T, width = 37, (H + 2 * KVH) * heads[2]
    assert rows_items(T, H, KVH, D, rows=True) == -(-((H + KVH) * D // 16 + KVH * D // 8) // ROWS_THREADS)
    assert rows_items(T, H, KVH, D) == 0 and rows_items(ROWS_MIN_ROWS, H, KVH, D) > 0  # by the step's tokens
    values = rng.standard_normal((T, width)).astype(np.float32) * (3000 if prod == "fp8sums" else 3)
    qkv = cp.asarray(values) if prod == "prod32" else to_dev(values, "bfloat16" if prod == "fp8sums" else dtype)
    scales = None
    if prod == "fp8sums":
        scales = (cp.asarray(rng.uniform(0.001, 0.01, T).astype(np.float32)),
                  cp.asarray(rng.uniform(0.001, 0.01, width).astype(np.float32)))
    bias = cp.asarray(rng.standard_normal(width).astype(np.float32)) if with_bias else None
    pos = cp.asarray(rng.integers(0, 40, T).astype(np.int32))
    ang = np.arange(40)[:, None] / 10000 ** (np.arange(0, D, 2) / D)[None]
    cos, sin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    scalar = np.uint16 if dtype == "bfloat16" else np.float16
    outs = []
    for rows in (False, True):
        k_cache = cp.zeros((2, 40 * T, KVH, D), np.uint8 if kv8 else scalar)
        v_cache = cp.zeros_like(k_cache)
        starts = cp.arange(T, dtype=cp.int64) * 40 * KVH * D * k_cache.itemsize
        q = cp.zeros((T, H, D), scalar)
        rope_kv_write(qkv, pos, cos, sin, k_cache.data.ptr + starts, v_cache.data.ptr + starts,
                      40 * T * KVH * D, H, KVH, D, q, bias=bias, kv_fp8=kv8, scales=scales, rows=rows)
        outs.append([cp.asnumpy(a) for a in (q, k_cache, v_cache)])
    for got, want in zip(outs[1], outs[0]):
        assert want.any()
        np.testing.assert_array_equal(got, want)
    assert not outs[1][1][0].any() and not outs[1][2][0].any()  # layer 0 untouched


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


@pytest.mark.parametrize("N", [100, 2048])
def test_gemv_rows_do_not_depend_on_the_batch(N):
    """The same bits whatever the rows, across kernels, tile counts and passes: rows of 1 KB take two
    feature tiles a block and passes of 3 chunks a warp at every row count (gemv.fitted_config);
    CONFIG and CONFIG_WIDE give them one tile at N = 100, and at N = 2048 CONFIG two
    (TWO_TILES_MIN_N_SHORT), CONFIG_WIDE one, past its first pass."""
    import kernels_cuda.gemv as gv
    from kernels_cuda.gemv import gemv, tiles
    assert all(gv.fitted_config(b, 1040) == {"WARPS": 8, "DEPTH": 6} for b in (1, 4, 5, 8, 9, 16))
    assert gv.fitted_config(1, 4104) is None  # past 4 KB: CONFIG and CONFIG_WIDE
    assert [tiles(b, False, 1040, N) for b in (1, 4, 5, 8)] == [2] * 4
    assert [tiles(1, False, 1040, N, c) for c in (gv.CONFIG, gv.CONFIG_WIDE)] == ([2, 1] if N == 2048 else [1, 1])
    x = to_dev(rng.standard_normal((16, 520)).astype(np.float32), "float16")
    w = to_dev(rng.standard_normal((N, 520)).astype(np.float32), "float16")
    together = cp.asnumpy(gemv(x, w))
    for b in range(16):
        np.testing.assert_array_equal(cp.asnumpy(gemv(x[b:b + 1], w))[0], together[b])
    for n in (4, 5, 8):  # the 8-row kernels too
        np.testing.assert_array_equal(cp.asnumpy(gemv(x[:n], w)), together[:n])
    for config in (gv.CONFIG, gv.CONFIG_WIDE):
        for n in (1, 4, 8):
            np.testing.assert_array_equal(cp.asnumpy(gemv(x[:n], w, config=config)), together[:n])


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


def test_gemv_staged_matrices(monkeypatch):
    """Which matrices stream through shared memory on a 132-SM GPU: Llama-3-8B's gate/up, down
    and o (one wave of 512 blocks), not its QKV (768 blocks), LM head, e4m3 matrices, or any
    SmolLM2 matrix (all under 16 MB)."""
    import kernels_cuda.gemv as gv
    monkeypatch.setattr(gv, "sm_count", lambda: 132)
    llama = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}
    assert {m for m, (n, k) in llama.items() if gv.staged(n, 2 * k, False)} == {"o", "gate_up", "down"}
    assert not any(gv.staged(n, k, True) for n, k in llama.values())
    smollm2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
    assert not any(gv.staged(n, 2 * k, False) for n, k in smollm2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [77, 2048])
def test_gemv_staged(dtype, N, monkeypatch):
    """Weights through shared memory in row segments (gemv.staged, forced here for small
    matrices): right against float64 on K with partial blocks and passes, the same bits at
    1-16 rows (both kernels and tile counts), and fused SiLU * up as gemv then silu_mul."""
    import kernels_cuda.gemv as gv
    from kernels_cuda import rmsnorm
    from kernels_cuda.activation import silu_mul
    from kernels_cuda.rmsnorm import rms_norm
    monkeypatch.setattr(gv, "STAGED_MIN_BYTES", 1)
    assert gv.staged(N, 528, False) and not gv.staged(N, 528, True) and not gv.staged(gv.TWO_TILES_MIN_N, 528, False)
    for K in (264, 520, 4104):
        x = rng.standard_normal((16, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32) * 0.2
        xd, wd = to_dev(x, dtype), to_dev(w, dtype)
        together = cp.asnumpy(gv.gemv(xd, wd))
        ref = rounded(x, dtype).astype(np.float64) @ rounded(w, dtype).T.astype(np.float64)
        np.testing.assert_allclose(together, ref, rtol=1e-4, atol=4e-4 * np.sqrt(K / 264))
        for b in (0, 5, 15):
            np.testing.assert_array_equal(cp.asnumpy(gv.gemv(xd[b:b + 1], wd))[0], together[b])
        for n in (4, 5, 8):
            np.testing.assert_array_equal(cp.asnumpy(gv.gemv(xd[:n], wd)), together[:n])
        if N % 16 == 0:
            for n in (1, 12):
                fused = gv.gemv_silu(xd[:n], wd, cp.zeros((n, N // 2), xd.dtype))
                separate = silu_mul(gv.gemv(xd[:n], wd), out_dtype=xd.dtype)
                np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(separate))
        if K <= 4 * rmsnorm.THREADS:  # a folded norm beside the staged buffers (its rows in the 7 KB left)
            for n in (1, 6):
                res = cp.asarray(rng.standard_normal((n, K)).astype(np.float32))
                weight = cp.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
                normed = rms_norm(res, weight, 1e-5, out=cp.zeros((n, K), xd.dtype))
                folded = gv.gemv(cp.zeros_like(normed), wd, norm=gv.NormIn(res, weight, 1e-5))
                np.testing.assert_array_equal(cp.asnumpy(folded), cp.asnumpy(gv.gemv(normed, wd)))


@pytest.mark.parametrize("wfp8", [False, True], ids=["w16", "w8"])
def test_gemv_weights_loaded_before_the_wait(wfp8, monkeypatch):
    """A block's first pass of weights loaded before it waits for the previous kernel
    (PRELOAD, used where a row fits in that pass) gives the bits of the plain kernel, also
    where the row takes several passes and a partial last one."""
    import kernels_cuda.gemv as gv
    for K in (272, 528, 4112):
        for B in (1, 6, 13):
            x = to_dev(rng.standard_normal((B, K)).astype(np.float32), "float16")
            w = maybe_fp8(to_dev(rng.standard_normal((77, K)).astype(np.float32), "float16"), wfp8)
            outs = []
            for early in (False, True):
                monkeypatch.setattr(gv, "preload", lambda *args, early=early: early)
                outs.append(cp.asnumpy(gv.gemv(x, w)))
            assert np.isfinite(outs[0]).all() and outs[0].any()
            np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wfp8", [False, True], ids=["w16", "w8"])
def test_gemv_folded_norm_is_add_rms_norm_then_gemv(dtype, wfp8):
    """A product that makes its rows by the residual add + RMSNorm (NormIn) gives the bits of
    add_rms_norm (or rms_norm) and then the product: its output, and the residual stream's
    next state in res_out, with res left as it was. K: one full pass of the norm block's
    threads (2,048), a partial last warp of them (1,008), SmolLM2's 576."""
    from kernels_cuda.gemv import NormIn, gemv, gemv_silu
    from kernels_cuda.rmsnorm import add_rms_norm, rms_norm
    for K, B in ((576, 13), (1008, 6), (2048, 1)):
        res = cp.asarray(rng.standard_normal((B, K)).astype(np.float32))
        delta = cp.asarray(rng.standard_normal((B, K)).astype(np.float32))
        bias = cp.asarray(rng.standard_normal(K).astype(np.float32))
        weight = cp.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
        w = maybe_fp8(to_dev(rng.standard_normal((96, K)).astype(np.float32) * 0.1, dtype), wfp8)
        x = cp.zeros((B, K), to_dev(np.zeros(1, np.float32), dtype).dtype)
        for with_delta in (False, True):
            summed, normed = res.copy(), cp.zeros_like(x)
            if with_delta:
                add_rms_norm(summed, delta, weight, 1e-5, out=normed, bias=bias)
            else:
                rms_norm(summed, weight, 1e-5, out=normed)
            res_before, res_out = res.copy(), cp.full((B, K), np.nan, np.float32)
            norm = NormIn(res, weight, 1e-5, delta if with_delta else None, bias if with_delta else None,
                          res_out if with_delta else None)
            np.testing.assert_array_equal(cp.asnumpy(gemv(x, w, norm=norm)), cp.asnumpy(gemv(normed, w)))
            act = cp.zeros((B, 48), x.dtype)
            np.testing.assert_array_equal(cp.asnumpy(gemv_silu(x, w, act, norm=norm)),
                                          cp.asnumpy(gemv_silu(normed, w, cp.zeros_like(act))))
            assert not x.any()  # x gives the shape and type only
            np.testing.assert_array_equal(cp.asnumpy(res), cp.asnumpy(res_before))
            if with_delta:
                np.testing.assert_array_equal(cp.asnumpy(res_out), cp.asnumpy(summed))


def maybe_fp8(w: cp.ndarray, wfp8: bool):
    """w itself, or w quantized to e4m3 rows (--quantization fp8)."""
    from kernels_cuda.quant import quantize_matrix
    return quantize_matrix(w) if wfp8 else w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 5, 12])
@pytest.mark.parametrize("wfp8", [False, True], ids=["w16", "w8"])
@pytest.mark.parametrize("inter", [88, 1024])
@pytest.mark.parametrize("K", [272, 4112])
def test_gemv_silu_is_gemv_then_silu_mul(dtype, B, wfp8, inter, K):
    """The gate/up product with SiLU * up in its epilogue gives the bits of the two kernels. Rows of
    K = 272 take two tiles a block (gemv.fitted_config), 16-bit rows of K = 4112 one at 1-8 rows
    (inter 88: 22 blocks of 4 gate/up pairs)."""
    from kernels_cuda.activation import silu_mul
    from kernels_cuda.gemv import gemv, gemv_silu
    x = to_dev(rng.standard_normal((B, K)).astype(np.float32), dtype)
    w = maybe_fp8(to_dev(rng.standard_normal((2 * inter, K)).astype(np.float32) * 0.2, dtype), wfp8)
    fused = gemv_silu(x, w, cp.zeros((B, inter), x.dtype))
    separate = silu_mul(gemv(x, w), out_dtype=x.dtype)
    np.testing.assert_array_equal(cp.asnumpy(fused), cp.asnumpy(separate))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("B", [1, 11])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("wfp8", [False, True], ids=["w16", "w8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("K", [144, 4112])
def test_gemv_rope_is_gemv_then_rope_kv_write(dtype, head_dim, B, kv8, wfp8, with_bias, K):
    """The QKV product with RoPE and the K/V write in its epilogue (its positions, tables,
    pointers and biases loaded before the wait) gives the bits of the two kernels: q, and the
    cache (other slots and layers untouched). 16-bit rows of K = 4112 take one tile a block at one
    row, those of K = 144 two (gemv.fitted_config)."""
    from kernels_cuda.gemv import gemv, gemv_rope
    from kernels_cuda.rope import rope_kv_write
    H, KVH, layers, layer = 6, 2, 2, 1
    width = (H + 2 * KVH) * head_dim
    x = to_dev(rng.standard_normal((B, K)).astype(np.float32), dtype)
    w = maybe_fp8(to_dev(rng.standard_normal((width, K)).astype(np.float32) * 0.2, dtype), wfp8)
    bias = cp.asarray(rng.standard_normal(width).astype(np.float32)) if with_bias else None
    pos = cp.asarray(rng.integers(0, 30, B).astype(np.int32))
    ang = np.arange(32)[:, None] / 10000 ** (np.arange(0, head_dim, 2) / head_dim)[None]
    cos, sin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    slots = B * 32
    results = []
    for run in ("fused", "separate"):
        kc = cp.zeros((layers, slots, KVH, head_dim), np.uint8 if kv8 else x.dtype)
        vc = cp.zeros_like(kc)
        starts = cp.arange(B, dtype=cp.int64) * 32 * KVH * head_dim * kc.itemsize
        kp, vp = kc.data.ptr + starts, vc.data.ptr + starts
        q = cp.zeros((B, H, head_dim), x.dtype)
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
@pytest.mark.parametrize("out16", [False, True], ids=["out32", "out16"])
def test_gemm(dtype, out16):
    from kernels_cuda.gemm import gemm
    x = rng.standard_normal((37, 200)).astype(np.float32)
    w = rng.standard_normal((111, 200)).astype(np.float32)
    xd = to_dev(x, dtype)
    out = gemm(xd, to_dev(w, dtype), cp.empty((37, 111), xd.dtype) if out16 else None)
    ref = rounded(x, dtype).astype(np.float64) @ rounded(w, dtype).T.astype(np.float64)
    if not out16:
        np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-3, atol=1e-2)
        return
    # float32 sums rounded once to the 16-bit type
    np.testing.assert_allclose(from_dev(out), rounded(ref.astype(np.float32), dtype), rtol=tol(dtype), atol=1e-2)
    with pytest.raises(ValueError, match="out"):
        gemm(xd, to_dev(w, dtype), cp.empty((37, 111), np.uint16 if dtype == "float16" else np.float16))


def fp8_rows_ref(q: cp.ndarray, scale: cp.ndarray) -> np.ndarray:
    """What e4m3 codes with a scale per row stand for, in float64."""
    return E4M3[cp.asnumpy(q)].astype(np.float64) * cp.asnumpy(scale).astype(np.float64)[:, None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows(dtype):
    """A scale per row = max |row| / 448 (1 for a zero row); codes = the row / scale rounded to
    e4m3 (the largest magnitude lands on 448)."""
    from kernels_cuda.quant import quantize_rows
    x = rng.standard_normal((7, 520)).astype(np.float32) * np.array([1, 1e-3, 50, 0, 1, 3, 1e3])[:, None]
    x[4, 17] = -9.0  # a row whose largest magnitude is negative
    q, scale = quantize_rows(to_dev(x, dtype))
    xr = rounded(x, dtype)
    amax = np.abs(xr).max(axis=1)
    np.testing.assert_allclose(cp.asnumpy(scale), np.where(amax > 0, amax / 448, 1.0), rtol=1e-6)
    codes = cp.asnumpy(q)
    for r in range(len(x)):
        assert_e4m3_of(codes[r], xr[r] / cp.asnumpy(scale)[r])
    assert E4M3[codes[4, 17]] == -448 and not (codes[3] & 0x7F).any()  # +-0


@pytest.mark.parametrize("dtype", DTYPES)
# threads a row, values a row: eight chunks of 8 a thread over two warps (the runner's 8B rows); four
# over four warps; one; one warp (no barrier)
@pytest.mark.parametrize("group_threads,K", [(64, 4096), (128, 4096), (64, 512), (32, 256)])
def test_quantize_rows_in_thread_groups(dtype, group_threads, K, monkeypatch):
    """Steps of quant.GROUP_MIN_ROWS rows or more take quantize_rows_group (a group of threads a
    row, several rows a block): quantize_rows' codes and scales, bit for bit (a max is exact in
    any order)."""
    from kernels_cuda import quant
    monkeypatch.setattr(quant, "GROUP_THREADS", group_threads)
    rows = quant.GROUP_MIN_ROWS + 1  # the last block holds one row
    assert quant.group_kernel(rows, K)
    x = rng.standard_normal((rows, K)).astype(np.float32) * np.geomspace(1e-3, 1e3, rows)[:, None]
    x[7] = 0  # scale 1
    x[9, 5] = -1e4  # the largest magnitude negative
    xd = to_dev(x, dtype)
    got = quant.quantize_rows(xd)
    monkeypatch.setattr(quant, "GROUP_MIN_ROWS", rows + 1)
    assert not quant.group_kernel(rows, K)
    want = quant.quantize_rows(xd)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(cp.asnumpy(a), cp.asnumpy(b))
    assert float(got[1][7]) == 1.0 and E4M3[int(got[0][9, 5])] == -448
    assert_e4m3_of(cp.asnumpy(got[0][rows - 1]), rounded(x[rows - 1], dtype) / float(got[1][rows - 1]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", ["rms_norm", "add_rms_norm", "silu_mul"])
@pytest.mark.parametrize("shape", ["held", "long", "wide"])  # long: rows past what registers hold; wide: many rows
def test_producers_quantize_their_output_for_a_float8_product(dtype, kernel, shape):
    """With `quant`, RMSNorm and SiLU * up also write their 16-bit output as e4m3 codes and a
    scale per row: the bits quantize_rows gives on that output, which stays as it was; with
    codes_only, the same codes and the 16-bit output left untouched."""
    from kernels_cuda.activation import silu_mul
    from kernels_cuda.quant import quantize_rows
    from kernels_cuda.rmsnorm import add_rms_norm, rms_norm
    T, hidden, inter = {"held": (37, 1040, 528), "long": (37, 9000, 20000), "wide": (600, 4096, 14336)}[shape]
    scalar = np.uint16 if dtype == "bfloat16" else np.float16
    width = inter if kernel == "silu_mul" else hidden
    x = (rng.standard_normal((T, hidden)) * np.linspace(0.1, 30, T)[:, None]).astype(np.float32)
    x[5] = 0  # a zero row: scale 1

    def run(quant, out=None, codes_only=False):
        kw = dict(out=out, out_dtype=scalar, quant=quant, codes_only=codes_only)
        if kernel == "silu_mul":
            gate_up = to_dev(rng.standard_normal((T, 2 * inter)).astype(np.float32) * 3, dtype)
            gate_up[5] = 0
            return silu_mul(gate_up, **kw)
        w = cp.asarray(rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        if kernel == "rms_norm":
            return rms_norm(cp.asarray(x), w, 1e-5, **kw)
        return add_rms_norm(cp.asarray(x), cp.asarray(x * 0.5), w, 1e-5, **kw)

    state = rng.bit_generator.state
    plain = run(None)
    rng.bit_generator.state = state  # the same inputs again
    q, qs = cp.full((T, width), 0x55, np.uint8), cp.zeros(T, np.float32)
    out = run((q, qs))
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(plain))
    ref_q, ref_s = quantize_rows(out)
    np.testing.assert_array_equal(cp.asnumpy(q), cp.asnumpy(ref_q))
    np.testing.assert_array_equal(cp.asnumpy(qs), cp.asnumpy(ref_s))
    assert float(qs[5]) == 1.0 and not (cp.asnumpy(q[5]) & 0x7F).any()
    rng.bit_generator.state = state
    untouched = cp.full((T, width), 0x1234, np.uint16).view(scalar)
    q2, qs2 = cp.zeros_like(q), cp.zeros_like(qs)
    run((q2, qs2), out=untouched, codes_only=True)
    assert (untouched.view(np.uint16) == 0x1234).all()
    np.testing.assert_array_equal(cp.asnumpy(q2), cp.asnumpy(q))
    np.testing.assert_array_equal(cp.asnumpy(qs2), cp.asnumpy(qs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("K", [272, 4096])
def test_gemv_fp8_weights(dtype, B, K):
    """The skinny GEMM on e4m3 weights with a scale per row: x (16-bit) against the weights'
    e4m3 values, summed in float32, times the row's scale."""
    from kernels_cuda.gemv import gemv
    from kernels_cuda.quant import quantize_matrix
    x = rng.standard_normal((B, K)).astype(np.float32)
    w = quantize_matrix(to_dev(rng.standard_normal((111, K)).astype(np.float32) * 0.05, dtype))
    out = gemv(to_dev(x, dtype), w)
    ref = rounded(x, dtype).astype(np.float64) @ fp8_rows_ref(w.data, w.scale).T
    scale = np.abs(ref).max()
    np.testing.assert_allclose(cp.asnumpy(out), ref, rtol=1e-4, atol=1e-5 * scale * np.sqrt(K / 272))


def test_gemv_fp8_rows_do_not_depend_on_the_batch():
    from kernels_cuda.gemv import gemv
    from kernels_cuda.quant import quantize_matrix
    x = to_dev(rng.standard_normal((16, 528)).astype(np.float32), "float16")
    w = quantize_matrix(to_dev(rng.standard_normal((100, 528)).astype(np.float32), "float16"))
    together = cp.asnumpy(gemv(x, w))
    for b in (0, 7, 8, 15):
        np.testing.assert_array_equal(cp.asnumpy(gemv(x[b:b + 1], w))[0], together[b])


def random_q8_0(N: int, K: int, r: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q8_0 matrix: int8 codes (the whole range), float16 scales a block of 32 (some zero, some so
    small that code x scale is a float16 subnormal, some subnormal themselves), and its values as
    the loader makes them (float32 products, exact)."""
    codes = r.integers(-128, 128, (N, K), dtype=np.int8)
    scales = (r.uniform(0.5, 2.0, (N, K // 32)) * 10.0 ** r.integers(-3, 0, (N, K // 32))).astype(np.float16)
    pick = r.random(scales.shape)
    scales[pick < 0.05] = 0
    scales[(pick >= 0.05) & (pick < 0.1)] = np.float16(3e-7)  # a subnormal scale
    scales[(pick >= 0.1) & (pick < 0.15)] = np.float16(2e-6)  # codes x scale below float16's normals
    values = codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1)
    return codes, scales, values


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_q8_0_values_are_the_loaders(dtype):
    """Each Q8_0 code times its block's scale becomes the 16-bit value the loader makes (the
    float32 product rounded once to the model's type): with one-hot rows of x every output is
    one such value, exactly (zero, subnormal and tiny scales included)."""
    from kernels_cuda.gemv import gemv
    from kernels_cuda.quant import Q8Matrix
    r = np.random.default_rng(13)
    N, K = 40, 96
    codes, scales, values = random_q8_0(N, K, r)
    w8 = Q8Matrix(cp.asarray(codes), cp.asarray(scales))
    for k0 in range(0, K, 16):
        onehot = np.zeros((16, K), np.float32)
        onehot[np.arange(16), k0 + np.arange(16)] = 1
        got = cp.asnumpy(gemv(to_dev(onehot, dtype), w8))
        np.testing.assert_array_equal(got, rounded(values[:, k0:k0 + 16], dtype).T)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(111, 576), (6144, 576), (77, 4128), (40, 96)])
def test_gemv_q8_0(dtype, N, K):
    """A GGUF Q8_0 matrix read as it is (a Q8Matrix, gemv.cu's W_Q8) against float64 over the
    values the loader makes, on rows of one pass (preloaded), several passes and a partial last
    pass; the same bits for a row whatever the batch (1-16 rows)."""
    from kernels_cuda.gemv import gemv
    from kernels_cuda.quant import Q8Matrix
    r = np.random.default_rng(11)
    codes, scales, values = random_q8_0(N, K, r)
    w8 = Q8Matrix(cp.asarray(codes), cp.asarray(scales))
    x = to_dev(r.standard_normal((16, K)).astype(np.float32), dtype)
    together = cp.asnumpy(gemv(x, w8))
    for B in (1, 3, 8, 9):
        np.testing.assert_array_equal(cp.asnumpy(gemv(x[:B], w8)), together[:B])
    np.testing.assert_array_equal(cp.asnumpy(gemv(x[12:13], w8))[0], together[12])
    ref = from_dev(x).astype(np.float64) @ rounded(values, dtype).T.astype(np.float64)
    assert np.isfinite(together).all() and together.any()
    np.testing.assert_allclose(together, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max() * np.sqrt(K / 576))


@pytest.mark.parametrize("q8", [False, True], ids=["w16", "q8_0"])
def test_gemv_tile_loop_gives_the_bits_of_a_block_a_tile(q8, monkeypatch):
    """TILE_LOOP: blocks looping over tiles (here 7 blocks, gemv.LOOP_MAX_GRID), each loading the
    next tile's weights before it stores this one's sums: the bits of a block a tile, with one and
    two tiles a block and a partial last tile; refused where a row does not fit the first pass."""
    import kernels_cuda.gemv as gv
    from kernels_cuda.quant import Q8Matrix
    r = np.random.default_rng(12)
    codes, scales, values = random_q8_0(1000, 576, r)
    w = Q8Matrix(cp.asarray(codes), cp.asarray(scales)) if q8 else to_dev(values, "float16")
    x = to_dev(r.standard_normal((16, 576)).astype(np.float32), "float16")
    monkeypatch.setattr(gv, "LOOP_MAX_GRID", 7)
    for B in (1, 4, 5, 8):
        config = gv.default_config(B)
        want = cp.asnumpy(gv.gemv(x[:B], w, config=config))
        got = cp.asnumpy(gv.gemv(x[:B], w, config={**config, "TILE_LOOP": 1}))
        assert np.isfinite(want).all() and want.any()
        np.testing.assert_array_equal(got, want)
    if not q8:  # 9 rows of 16-bit weights: two tiles of 2 chunks a warp, past the row
        with pytest.raises(ValueError, match="TILE_LOOP"):
            gv.gemv(x[:9], w, config={**gv.default_config(9), "TILE_LOOP": 1})


def test_gemv_q8_0_checks_its_matrix():
    from kernels_cuda.gemv import gemv
    from kernels_cuda.quant import Q8Matrix
    x = cp.zeros((1, 64), np.float16)
    with pytest.raises(ValueError, match="w.scale"):
        gemv(x, Q8Matrix(cp.zeros((8, 64), np.int8), cp.zeros((8, 1), np.float16)))
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv(cp.zeros((1, 48), np.float16), Q8Matrix(cp.zeros((8, 48), np.int8), cp.zeros((8, 1), np.float16)))


@pytest.mark.parametrize("M", [17, 64, 300])
def test_gemm_fp8(M):
    """cuBLASLt's e4m3 product: the float32 sums over the codes' values, which with the scales
    per token and per feature come close to the 16-bit product."""
    from kernels_cuda.gemm import gemm_fp8
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    K, N = 1040, 208
    x = to_dev(rng.standard_normal((M, K)).astype(np.float32), "float16")
    w = quantize_matrix(to_dev(rng.standard_normal((N, K)).astype(np.float32) * 0.05, "float16"))
    xq, xs = quantize_rows(x)
    out = cp.asnumpy(gemm_fp8(xq, w, cp.zeros((M, N), np.float32)))
    ref = E4M3[cp.asnumpy(xq)].astype(np.float64) @ E4M3[cp.asnumpy(w.data)].T.astype(np.float64)
    # Hopper's fp8 MMAs add with fewer bits than float32 between cuBLASLt's promotions (H200:
    # differences up to 2.5e-4 of the largest sum here)
    np.testing.assert_allclose(out, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())
    # the same sums written in bfloat16 (what the runner asks for): rounded once
    out16 = from_dev(gemm_fp8(xq, w, cp.zeros((M, N), np.uint16)))
    np.testing.assert_allclose(out16, rounded(out, "bfloat16"), rtol=2 ** -7, atol=1e-3 * np.abs(ref).max())
    scaled = out * cp.asnumpy(xs)[:, None] * cp.asnumpy(w.scale)[None, :]
    exact = from_dev(x).astype(np.float64) @ fp8_rows_ref(w.data, w.scale).T
    assert rel(scaled, exact) < 0.05  # e4m3 keeps ~3 significant bits a value


@pytest.mark.parametrize("M", [17, 300, 1100])
@pytest.mark.parametrize("fast", [False, True])
def test_gemm_fp8_scaled_in_the_epilogue(M, fast):
    """gemm_fp8_scaled: cuBLASLt scales the weights' rows and the tokens in its epilogue, so its
    bfloat16 out is the product of the scaled matrices, rounded once: against the exact sums of
    the codes' values times both scales, and against gemm_fp8's raw sums scaled after. Where
    cuBLASLt has no algorithm for it, it says so and writes nothing."""
    from kernels_cuda import gemm as G
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    K, N = 1040, 208
    x = to_dev(rng.standard_normal((M, K)).astype(np.float32), "float16")
    w = quantize_matrix(to_dev(rng.standard_normal((N, K)).astype(np.float32) * 0.05, "float16"))
    xq, xs = quantize_rows(x)
    out = cp.full((M, N), 0x7FC0, np.uint16)  # bfloat16 NaNs: what is not written stays NaN
    if not G.gemm_fp8_scaled(xq, xs, w, out, fast):
        assert np.isnan(from_dev(out)).all()
        pytest.skip("this cuBLASLt has no fp8 algorithm with outer-vector scales")
    got = from_dev(out)
    exact = (E4M3[cp.asnumpy(xq)].astype(np.float64) @ E4M3[cp.asnumpy(w.data)].T.astype(np.float64)
             * cp.asnumpy(xs)[:, None] * cp.asnumpy(w.scale)[None, :])
    big = np.abs(exact).max()
    # bfloat16's rounding (2^-9 of a value) and the MMAs' sums (fast: up to ~1e-2 of the largest)
    np.testing.assert_allclose(got, exact, rtol=2 ** -8, atol=(1e-2 if fast else 1e-3) * big)
    raw = from_dev(G.gemm_fp8(xq, w, cp.zeros((M, N), np.uint16), fast))
    after = raw * cp.asnumpy(xs)[:, None] * cp.asnumpy(w.scale)[None, :]
    np.testing.assert_allclose(got, after, rtol=2 ** -7, atol=(1e-2 if fast else 1e-3) * big)
    # add: out += the product, in the epilogue (a residual stream's add): within bfloat16's rounding
    # of the sum and of the product (H200: cuBLASLt's sums show both) and the MMAs' error
    c = rounded(rng.standard_normal((M, N)).astype(np.float32) * big, "bfloat16")
    acc = to_dev(c, "bfloat16")
    assert G.gemm_fp8_scaled(xq, xs, w, acc, fast, add=True)
    err = np.abs(from_dev(acc) - (c + exact))
    assert (err <= 2 ** -8 * (np.abs(c + exact) + np.abs(exact)) + (1e-2 if fast else 1e-3) * big).all()
    assert err.max() < 0.05 * np.abs(exact).max()


def test_untuned_fp8_products_leave_the_workspace_alone():
    """A product that was not tuned runs with no cuBLASLt workspace where an algorithm needs none
    (gemm's note on workspaces). Given one, cuBLASLt's algorithm for a scaled product takes a
    tile scheduler whose counter lives in the workspace, zeroed by a memset before each product,
    and in a serving step that memset left the device idle ~4.5 us a product. At a mixed step's
    qkv shape the workspace keeps its bytes through a scaled and an unscaled product; an
    algorithm that asks for workspace, run with it, does write there, so the check sees such a
    counter where there is one."""
    from kernels_cuda import gemm as G
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    M, K, N = 2040, 4096, 6144
    xq, xs = quantize_rows(to_dev(rng.standard_normal((M, K)).astype(np.float32), "float16"))
    w = quantize_matrix(to_dev(rng.standard_normal((N, K)).astype(np.float32) * 0.05, "float16"))
    out = cp.zeros((M, N), np.uint16)
    lt = G._lt_handle()
    lt.workspace.fill(0xFF)
    if not G.gemm_fp8_scaled(xq, xs, w, out, True):
        pytest.skip("this cuBLASLt has no fp8 algorithm with outer-vector scales")
    cp.cuda.Device().synchronize()
    assert (lt.workspace[:4096] == 0xFF).all()
    assert np.isfinite(from_dev(out)).all() and np.abs(from_dev(out)).max() > 0
    G._lt_product(xq, w, out, M, N, K, G.CUDA_R_16BF, True)
    cp.cuda.Device().synchronize()
    assert (lt.workspace[:4096] == 0xFF).all()
    plan = lt.plan(M, N, K, G.CUDA_R_16BF, True)
    asks = [algo for algo in lt._heuristic(*plan[:4], M, N, K, count=8) if algo.workspaceSize]
    if asks:
        assert lt.matmul(plan, asks[0], xq, w, out) == 0
        cp.cuda.Device().synchronize()
        assert not (lt.workspace[:4096] == 0xFF).all()


@pytest.mark.parametrize("K", [1040, 4096, 14336])
def test_gemm_fp8_fast_accumulation(K):
    """fast_accum (the runner's default, --fp8-accumulation fast): the tensor cores' sums are
    never promoted to float32, so they drift from the exact sums of the codes' values by more
    than the promoted ones, and more with K; the drift stays an order of magnitude under what
    rounding the inputs to e4m3 costs. (H200, 8B shapes: rms 1.7e-3 of the sums at K = 4,096,
    3.2e-3 at 14,336; promoted 2e-4; e4m3's rounding 3.6e-2.)"""
    from kernels_cuda.gemm import gemm_fp8
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    M, N = 300, 256
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, :8] *= 20  # outlier channels, as activations have
    x = to_dev(x, "float16")
    w = quantize_matrix(to_dev(rng.standard_normal((N, K)).astype(np.float32) * 0.02, "float16"))
    xq, xs = quantize_rows(x)
    ref = E4M3[cp.asnumpy(xq)].astype(np.float64) @ E4M3[cp.asnumpy(w.data)].T.astype(np.float64)
    fast = cp.asnumpy(gemm_fp8(xq, w, cp.zeros((M, N), np.float32), fast_accum=True))
    promoted = cp.asnumpy(gemm_fp8(xq, w, cp.zeros((M, N), np.float32)))

    def rms(a):
        return float(np.sqrt(((a - ref) ** 2).mean() / (ref ** 2).mean()))

    assert rms(promoted) < 1e-3 and rms(fast) < 1e-2
    assert np.abs(fast - ref).max() < 2e-2 * np.abs(ref).max()
    exact = from_dev(x).astype(np.float64) @ fp8_rows_ref(w.data, w.scale).T
    scaled = ref * cp.asnumpy(xs)[:, None] * cp.asnumpy(w.scale)[None, :]
    assert rms(fast) < 0.3 * float(np.sqrt(((scaled - exact) ** 2).mean() / (exact ** 2).mean()))


READER_SHAPE = dict(T=5, H=4, KVH=2, D=64, hidden=96, inter=48)


def run_reader(kernel: str, x: cp.ndarray, scales) -> list:
    """Run one of the kernels that read a matrix product (x) on fixed inputs otherwise; its outputs."""
    T, H, KVH, D, hidden = (READER_SHAPE[k] for k in ("T", "H", "KVH", "D", "hidden"))
    if kernel == "silu_mul":
        from kernels_cuda.activation import silu_mul
        return [silu_mul(x, scales=scales)]
    if kernel == "add_rms_norm":
        from kernels_cuda.rmsnorm import add_rms_norm
        residual = cp.asarray(np.linspace(-1, 1, T * hidden, dtype=np.float32).reshape(T, hidden))
        out = add_rms_norm(residual, x, cp.ones(hidden, np.float32), 1e-5, scales=scales)
        return [residual, out]
    from kernels_cuda.rope import rope_kv_write
    ang = np.arange(16)[:, None] / 10000 ** (np.arange(0, D, 2) / D)[None]
    cos, sin = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    kc, vc = cp.zeros((1, 16 * T, KVH, D), np.float16), cp.zeros((1, 16 * T, KVH, D), np.float16)
    starts = cp.arange(T, dtype=cp.int64) * 16 * KVH * D * 2
    q = cp.zeros((T, H, D), np.float16)
    rope_kv_write(x, cp.arange(T, dtype=cp.int32), cos, sin, kc.data.ptr + starts, vc.data.ptr + starts, 0,
                  H, KVH, D, q, scales=scales)
    return [q, kc, vc]


def reader_width(kernel: str) -> int:
    H, KVH, D = READER_SHAPE["H"], READER_SHAPE["KVH"], READER_SHAPE["D"]
    return {"silu_mul": 2 * READER_SHAPE["inter"], "rope_kv_write": (H + 2 * KVH) * D,
            "add_rms_norm": READER_SHAPE["hidden"]}[kernel]


@pytest.mark.parametrize("kernel", ["silu_mul", "rope_kv_write", "add_rms_norm"])
def test_readers_scale_a_float8_product(kernel):
    """Given a float8 product's (per token, per feature) scales, the kernels that read its
    output give the bits they give on the output scaled beforehand ((v * rs) * cs)."""
    T, width = READER_SHAPE["T"], reader_width(kernel)
    raw = cp.asarray(rng.standard_normal((T, width)).astype(np.float32) * 100)
    rs = cp.asarray(rng.uniform(0.001, 0.01, T).astype(np.float32))
    cs = cp.asarray(rng.uniform(0.001, 0.01, width).astype(np.float32))
    scaled = raw * rs[:, None] * cs[None, :]
    for got, want in zip(run_reader(kernel, raw, (rs, cs)), run_reader(kernel, scaled, None)):
        assert got.any()
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))


@pytest.mark.parametrize("kernel", ["silu_mul", "rope_kv_write", "add_rms_norm"])
@pytest.mark.parametrize("prod", DTYPES)
@pytest.mark.parametrize("fp8", [False, True], ids=["16bit", "fp8sums"])
def test_readers_take_a_16_bit_product(kernel, prod, fp8):
    """A product written in 16 bits (cuBLAS / cuBLASLt for steps of many rows) reads as the
    float32 of the same values: the same bits out, scaled (float8 sums in bfloat16) or not."""
    if fp8 and prod == "float16":
        pytest.skip("float8 sums are written in bfloat16")
    T, width = READER_SHAPE["T"], reader_width(kernel)
    values = rng.standard_normal((T, width)).astype(np.float32) * (3000 if fp8 else 3)
    scales = None
    if fp8:
        scales = (cp.asarray(rng.uniform(0.001, 0.01, T).astype(np.float32)),
                  cp.asarray(rng.uniform(0.001, 0.01, width).astype(np.float32)))
    as16 = to_dev(values, prod)
    as32 = cp.asarray(from_dev(as16))
    for got, want in zip(run_reader(kernel, as16, scales), run_reader(kernel, as32, scales)):
        assert got.any()
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))


def kv_cache_rows(kv8: bool, rows: int, region: int, kv_heads: int, head_dim: int, dtype: str = "float16") -> tuple:
    """Random K and V for `rows` sequences of `region` slots each, in a cache as the attention
    kernels read it (e4m3 codes, or the 16-bit dtype): (the values as stored, float32 (2, rows,
    region, kv_heads, head_dim); k_ptrs; v_ptrs; the cache, to keep it alive)."""
    kv = rng.standard_normal((2, rows, region, kv_heads, head_dim)).astype(np.float32)
    if kv8:
        codes = to_e4m3(kv)
        kv, pool = E4M3[codes], cp.asarray(codes)
    else:
        kv = rounded(kv, dtype)
        pool = to_dev(kv, dtype)
    row_bytes = region * kv_heads * head_dim * pool.itemsize
    kp = cp.asarray(pool.data.ptr + np.arange(rows) * row_bytes, dtype=cp.int64)
    return kv, kp, kp + rows * row_bytes, pool


def test_flash_decode_buffers_and_splits_by_grid(monkeypatch):
    """On 132 SMs (H200), 8B fp8 heads (8 KV heads), where they were measured:
    - flash_decode.buffers: 2 without PDL; 4 where the blocks fit the SMs at once; 3 for q K^T on
      wgmma with rows in one or two splits over up to two waves of four blocks an SM (32-132
      rows), where three were faster; 2 past that (160 rows of one split were slower with 3), for
      rows in more splits and for the other forms;
    - the runner's split plan: with q K^T on wgmma (two blocks an SM to fill) 32 rows take 2
      splits and 64 rows 1, where the other forms' plan (four an SM) gives 3 and 2."""
    import kernels_cuda.flash_decode as fd
    from engine.runner.cuda_runner import DECODE_BLOCKS_PER_SM, WGMMA_DECODE_BLOCKS_PER_SM, decode_split_plan
    monkeypatch.setattr(fd, "sm_count", lambda: 132)
    pick = lambda rows, splits, pdl=True, wgmma=True: fd.buffers(rows * 8 * splits, pdl, 128, True, 4, wgmma, splits)
    assert [pick(r, 1) for r in (1, 16, 64, 96, 128, 132, 160, 256)] == [4, 4, 3, 3, 3, 3, 2, 2]
    assert [pick(32, 2), pick(64, 2), pick(66, 2), pick(67, 2), pick(32, 3)] == [3, 3, 3, 2, 2]
    assert [pick(64, 1, pdl=False), pick(32, 4), pick(128, 1, wgmma=False)] == [2, 2, 2]
    splits = lambda rows, per_sm: decode_split_plan(rows, 8, 2048, 132, per_sm).splits
    assert [splits(r, WGMMA_DECODE_BLOCKS_PER_SM) for r in (32, 64, 128, 256)] == [2, 1, 1, 1]
    assert [splits(r, DECODE_BLOCKS_PER_SM) for r in (32, 64, 128, 256)] == [3, 2, 1, 1]
    assert decode_split_plan(16, 8, 2048, 132, WGMMA_DECODE_BLOCKS_PER_SM) == decode_split_plan(16, 8, 2048, 132)
    # tile groups (16-bit K/V, SmolLM2's 64-dim heads): two buffers a group where the blocks fit the SMs at
    # once, one past that or at 128 dims (8 would take 276 KB); up to 16 rows only, a row of up to 512 keys whole
    assert [fd.grouped_buffers(b, 64) for b in (3, 48, 132, 133)] == [8, 8, 8, 4]
    assert fd.grouped_buffers(8, 128) == 4
    assert decode_split_plan(1, 3, 2048, 132, grouped=True) == (128, 16, 512, 768, True)
    assert decode_split_plan(16, 3, 2048, 132, grouped=True) == (128, 11, 512, 0, True)
    assert decode_split_plan(32, 3, 2048, 132, grouped=True) == decode_split_plan(32, 3, 2048, 132)


@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("splits,chunk,window,heads,min_blocks,whole,short", [
    (6, 128, 0, (8, 2), 1, 0, 0), (2, 128, 0, (8, 2), 1, 0, 0), (1, 256, 0, (8, 2), 1, 0, 0),
    (3, 128, 300, (8, 2), 1, 0, 0), (2, 128, 0, (16, 1), 1, 0, 0), (1, 256, 0, (8, 2), 4, 0, 0),
    (3, 128, 300, (8, 2), 4, 0, 0), (6, 128, 0, (8, 2), 1, 256, 0), (3, 128, 300, (8, 2), 1, 320, 0),
    (16, 128, 0, (8, 2), 1, 256, 1024), (10, 128, 0, (8, 2), 1, 0, 640), (8, 128, 300, (8, 2), 1, 0, 512),
    (3, 128, 300, (14, 2), 1, 0, 0), (2, 128, 0, (4, 4), 1, 0, 0), (3, 128, 300, (6, 2), 4, 0, 0),
    (1, 256, 0, (4, 2), 1, 0, 0), (1, 512, 0, (6, 2), 1, 512, 0)])
@pytest.mark.parametrize("D", [64, 128])
def test_flash_decode(kv8, splits, chunk, window, heads, min_blocks, whole, short, D, monkeypatch):
    """Split-KV decode attention against softmax(q k^T * scale) v in float64: rows of various
    lengths (0: a padding row) in `splits` splits of `chunk` keys, or longer ones where those do
    not cover a row (2 splits for 1,000 keys: two of 512); `window`: sliding-window attention;
    16 query heads a KV head (all 16 rows of the tile live), 7 (fp8: the form with keys as the
    MMA's rows, whose 8 head columns one group of up to 8 fills), 4, 3, 2 and 1 (fp8 at head dim
    128 on Hopper: q K^T on wgmma, flash_decode.qk_wgmma); min_blocks 4: the launch bounds of
    large fp8 grids, forced on this small one; `whole`: rows of at most that many keys (after
    the window) take one split, which writes no partials; `short`: longer rows of at most that
    many keys take splits of 64 (1,000 keys in 16, 640 in 10). Head dims 64 (SmolLM2) and 128
    (the 8B shapes). Launched with programmatic dependent launch (sm_90), where it loads its
    buffers' tiles before its wait instead of one tile, with two, three and four buffers (a tile's
    wait leaving the ones after it in flight), it gives the same bits. In tile groups (16-bit K/V,
    `grouped`: four groups of 4 warps, each over its own tiles of a split) it has bits of its own,
    the same with one or two buffers a group (every tile of a row of up to 4 or 8 tiles before the
    wait, or a group's later tiles after its earlier ones), with or without PDL, and the same bound."""
    import kernels_cuda.flash_decode as fd
    from kernels_cuda._module import pdl_supported
    from kernels_cuda.flash_decode import flash_decode
    if min_blocks != 1:
        if not kv8:
            pytest.skip("four blocks an SM are for fp8 K/V")
        monkeypatch.setattr(fd, "min_blocks", lambda *args: min_blocks)
    (H, KVH), region = heads, 1024
    lens = np.array([1, 70, 129, 0, 640, 1000], np.int32)
    B = len(lens)
    q = rng.standard_normal((B, H, D)).astype(np.float32)
    kv, kp, vp, _pool = kv_cache_rows(kv8, B, region, KVH, D)
    q_dev = cp.asarray(q.astype(np.float16))
    part_o, part_ml = cp.zeros((B, H, splits, D), np.float32), cp.zeros((B, H, splits, 2), np.float32)
    counters, out = cp.zeros((B, KVH), np.int32), cp.full((B, H, D), np.nan, np.float16)
    scale = D ** -0.5
    for _ in range(2):  # the counters are back to zero for the next launch
        flash_decode(q_dev, kp, vp, cp.asarray(lens), 0, KVH, part_o, part_ml, counters, out, scale, chunk=chunk,
                     window=window, kv_fp8=kv8, whole=whole, short=short)
    assert not counters.any()
    for bufs in (2, 3, 4) if pdl_supported() else ():  # with PDL: all buffers' tiles before the wait, the same bits
        monkeypatch.setattr(fd, "buffers", lambda *args, n=bufs: n)
        ahead = cp.full_like(out, np.nan)
        flash_decode(q_dev, kp, vp, cp.asarray(lens), 0, KVH, part_o, part_ml, counters, ahead, scale, chunk=chunk,
                     window=window, kv_fp8=kv8, whole=whole, short=short, pdl=True)
        assert not counters.any()
        np.testing.assert_array_equal(cp.asnumpy(ahead).view(np.uint16), cp.asnumpy(out).view(np.uint16))
    outs = [out]
    if not kv8:
        deep = (4, 8) if fd.smem_bytes(D, bufs=8) <= fd.GROUPED_MAX_SMEM else (4,)
        for bufs, pdl in [(n, p) for n in deep for p in ((False, True) if pdl_supported() else (False,))]:
            monkeypatch.setattr(fd, "grouped_buffers", lambda *args, n=bufs: n)
            grouped = cp.full_like(out, np.nan)
            flash_decode(q_dev, kp, vp, cp.asarray(lens), 0, KVH, part_o, part_ml, counters, grouped, scale,
                         chunk=chunk, window=window, whole=whole, short=short, pdl=pdl, grouped=True)
            assert not counters.any()
            if len(outs) > 1:
                np.testing.assert_array_equal(cp.asnumpy(grouped).view(np.uint16), cp.asnumpy(outs[1]).view(np.uint16))
            else:
                outs.append(grouped)

    def split_count(span: int) -> int:  # the kernel's plan for a row
        length = max(chunk, -(-span // (splits * 64)) * 64)
        if span <= short:
            length = 64
        if span <= whole:
            length = max(length, -(-span // 64) * 64)
        return -(-span // length)

    spans = np.minimum(lens, window) if window else lens
    partials = cp.asnumpy(part_ml[:, :, :, 1]).any(axis=(1, 2))  # a split wrote its sum
    np.testing.assert_array_equal(partials, [split_count(int(n)) > 1 for n in spans])
    qr = rounded(q, "float16").astype(np.float64)
    for got in (cp.asnumpy(o).astype(np.float64) for o in outs):
        for b, n in enumerate(lens):
            if n == 0:
                continue
            for h in range(H):
                ref = attend_f64(kv, b, n, window, h // (H // KVH), qr[b, h], scale)
                # P and the output pass through 16 bits
                np.testing.assert_allclose(got[b, h], ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("grouped", [False, True], ids=["warps4", "groups"])
def test_timeline_points_stamp_where_named(grouped):
    """bench/kernels.py --timeline --points: a flash_decode launch in a Timeline with points stamps
    once past its wait and once at each of its STAMP_POINTS, in that order, as its names say; a
    second Timeline gets the stamps of the module the first one built (it is cached)."""
    from kernels_cuda._module import STAMP_POINTS, Timeline
    from kernels_cuda.flash_decode import flash_decode
    (H, KVH), D, region = (6, 2), 64, 512
    lens = np.array([300, 70], np.int32)
    kv, kp, vp, _pool = kv_cache_rows(False, 2, region, KVH, D)
    q = cp.asarray(rng.standard_normal((2, H, D)).astype(np.float16))
    part_o, part_ml = cp.zeros((2, H, 1, D), np.float32), cp.zeros((2, H, 1, 2), np.float32)
    out = cp.zeros((2, H, D), np.float16)
    for _ in range(2):
        tl = Timeline(points=True)
        with tl.compiling():
            flash_decode(q, kp, vp, cp.asarray(lens), 0, KVH, part_o, part_ml, cp.zeros((2, KVH), np.int32), out,
                         D ** -0.5, chunk=512, whole=512, grouped=grouped)
        cp.cuda.Device().synchronize()
        stamps = tl.read()
        points = STAMP_POINTS["flash_decode_chunk"]
        assert tl.names == ["flash_decode_chunk", *(f"flash_decode_chunk:{p}" for p in points)]
        assert len(stamps) == len(tl.names) and (np.diff(stamps) >= 0).all()


@pytest.mark.parametrize("D", [64, 128])
def test_flash_decode_bfloat16_fp8_multiplies_in_float16(D):
    """fp8 K/V with at most 8 query heads a KV head (the form with the keys as the MMA's rows): a
    bfloat16 model's q goes to float16 (held to its range) and the MMAs take float16 operands, as
    e4m3 widens to float16 in one convert. So the output is the float16 launch's on the same q to
    within bfloat16's rounding of the same float32 sums, and a q past float16's range gives a finite
    output. (On Hopper at head dim 128 q K^T runs on wgmma, from q's e4m3 codes scaled a head at a
    time, the same codes from either type where q is within float16's range; the head past it
    scales otherwise: see below.)"""
    from kernels_cuda.flash_decode import flash_decode, qk_wgmma
    (H, KVH), region, splits = (8, 2), 1024, 3
    lens = np.array([1, 70, 129, 0, 640, 1000], np.int32)
    B = len(lens)
    q = rng.standard_normal((B, H, D)).astype(np.float32) * 4
    q[4, 1, 5] = 1e5  # past float16's range
    q = rounded(q, "bfloat16")
    kv, kp, vp, _pool = kv_cache_rows(True, B, region, KVH, D)

    def run(dtype: str, qv: np.ndarray) -> np.ndarray:
        out = cp.full((B, H, D), np.nan, np.uint16 if dtype == "bfloat16" else np.float16)
        part_o, part_ml = cp.zeros((B, H, splits, D), np.float32), cp.zeros((B, H, splits, 2), np.float32)
        flash_decode(to_dev(qv, dtype), kp, vp, cp.asarray(lens), 0, KVH, part_o, part_ml,
                     cp.zeros((B, KVH), np.int32), out, D ** -0.5, chunk=128, kv_fp8=True)
        return from_dev(out)

    got = run("bfloat16", q)
    want = run("float16", np.clip(q, -65504, 65504))  # the same float16 operands
    live = lens > 0
    assert np.isfinite(got[live]).all() and np.abs(got[live]).max() > 0
    far = np.zeros((B, H), bool)
    far[4, 1] = True
    tight = live[:, None] & ~far if qk_wgmma(H // KVH, True, D) else np.broadcast_to(live[:, None], (B, H))
    np.testing.assert_allclose(got[tight], want[tight], rtol=2.0 ** -8, atol=1e-6)
    # on wgmma, the head past float16's range scales by its largest value, which puts the rest among
    # e4m3's subnormals (~5 bits, hi and lo codes together): they decide between the keys that tie on
    # the large value's product, so that head's weights differ; its output is still a weighted mean
    # of V's rows
    v = kv[1, 4, :lens[4], 1 // (H // KVH)]
    assert (np.abs(got[4, 1]) <= np.abs(v).max(axis=0) * (1 + 2 ** -7)).all()


@pytest.mark.parametrize("heads", [(8, 2), (6, 2), (8, 4), (6, 6)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_flash_decode_qk_on_wgmma(dtype, heads, monkeypatch):
    """Hopper, fp8 K/V, 4, 3, 2 and 1 query heads a KV head (fewer than 4 leave the MMA's columns
    past the group's hi and lo codes zero), head dim 128: q K^T on wgmma from q's hi and lo e4m3
    codes (flash_decode.qk_wgmma) against softmax(q k^T * scale) v in float64, and against the
    form on float16 MMAs: heads of plain values, a head of zeros, a head whose one large value puts
    the rest among e4m3's subnormals, a head of tiny values, rows of one split and of several."""
    import kernels_cuda.flash_decode as fd
    from kernels_cuda._module import wgmma_supported
    if not wgmma_supported():
        pytest.skip("wgmma needs an sm_90 GPU")
    (H, KVH), D, region, splits = heads, 128, 1024, 4
    assert fd.qk_wgmma(H // KVH, True, D) and not fd.qk_wgmma(H // KVH, False, D)
    assert not fd.qk_wgmma(H // KVH, True, 64) and not fd.qk_wgmma(5, True, D) and not fd.qk_wgmma(8, True, D)
    lens = np.array([1, 64, 130, 0, 575, 1000], np.int32)
    B = len(lens)
    q = rng.standard_normal((B, H, D)).astype(np.float32) * 2
    q[:, 1] = 0.0  # a head of zeros
    q[:, 2] *= 1e-5
    q[:, 2, 7] = 2.0  # one value of the head ~2^17 times the others: they scale into e4m3's subnormals
    q[:, 5] *= 1e-6  # tiny values
    q = rounded(q, dtype)
    kv, kp, vp, _pool = kv_cache_rows(True, B, region, KVH, D)

    def run(wgmma: bool) -> np.ndarray:
        monkeypatch.setattr(fd, "QK_WGMMA", wgmma)
        out = cp.full((B, H, D), np.nan, np.uint16 if dtype == "bfloat16" else np.float16)
        part_o, part_ml = cp.zeros((B, H, splits, D), np.float32), cp.zeros((B, H, splits, 2), np.float32)
        fd.flash_decode(to_dev(q, dtype), kp, vp, cp.asarray(lens), 0, KVH, part_o, part_ml,
                        cp.zeros((B, KVH), np.int32), out, D ** -0.5, chunk=128, kv_fp8=True)
        return from_dev(out).astype(np.float64)

    got, other = run(True), run(False)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        for h in range(H):
            ref = attend_f64(kv, b, n, 0, h // (H // KVH), q[b, h], D ** -0.5)
            tol = np.abs(ref).max()
            np.testing.assert_allclose(got[b, h], ref, rtol=2e-2, atol=2e-2 * tol)
            np.testing.assert_allclose(got[b, h], other[b, h], rtol=0, atol=8e-3 * tol)


@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("heads,window,D", [((8, 2), 0, 64), ((8, 2), 100, 64), ((6, 2), 0, 64), ((4, 4), 0, 64),
                                            ((8, 2), 0, 128), ((8, 2), 100, 128), ((6, 2), 0, 128), ((4, 4), 0, 128)])
def test_flash_prefill(kernel, kv8, heads, window, D, monkeypatch):
    """Ragged causal prefill attention against softmax(q k^T * scale) v in float64: chunks
    after a cached prefix (start > 0), one of a single query, one over three 64-query
    tiles, launched the tiles with the most keys first (flash_prefill.tiles); `window`:
    sliding-window attention; 4 and 3 query heads a KV head, and one; head dims 64 and 128.
    Both kernels: flash_prefill.cu and, on Hopper, flash_prefill_wgmma.cu. Blocks that take
    two query heads of a KV head (flash_prefill.cu: what a launch with a long sequence gets,
    flash_prefill.heads_per_block; flash_prefill_wgmma.cu: two consumer warpgroups) give the
    bits of blocks that take one. flash_prefill_wgmma.cu gives flash_prefill.cu's bits, also
    with three persistent blocks taking every work item in turn, and with the tile count read
    on the device (tiles_on_device: a graph's launch) from tile arrays longer than it: the same
    bits, and the rows of tiles past the count stay unwritten; flash_prefill.cu refuses it."""
    import kernels_cuda.flash_prefill as fp
    from kernels_cuda._module import wgmma_supported
    if kernel == "wgmma" and not wgmma_supported():
        pytest.skip("flash_prefill_wgmma.cu needs an sm_90 GPU")
    monkeypatch.setattr(fp, "WGMMA", kernel == "wgmma")
    monkeypatch.setattr(fp, "WGMMA_MIN_KEYS", dict.fromkeys(fp.WGMMA_MIN_KEYS, 0))
    (H, KVH), region = heads, 512
    starts, q_lens = np.array([0, 37, 100, 5], np.int32), np.array([70, 1, 150, 64], np.int32)
    kv_lens, S, T = starts + q_lens, len(q_lens), int(q_lens.sum())
    q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    kv, kp, vp, _pool = kv_cache_rows(kv8, S, region, KVH, D)
    assert all(t.size == 0 for t in fp.tiles(np.zeros(0, np.int32), np.zeros(0, np.int32)))  # one-token rows only
    tile_seq, tile_q0 = fp.tiles(q_lens, kv_lens)
    # every 64 queries of every chunk once, the tiles with the most keys first
    assert sorted(zip(tile_seq.tolist(), tile_q0.tolist())) == [
        (s, q0) for s in range(S) for q0 in range(0, int(q_lens[s]), fp.BLOCK_M)]
    keys = starts[tile_seq] + np.minimum(tile_q0 + fp.BLOCK_M, q_lens[tile_seq])
    assert keys.tolist() == sorted(keys.tolist(), reverse=True) and keys[0] == 250
    args = (cp.asarray(q.astype(np.float16)), cp.asarray(tile_seq), cp.asarray(tile_q0), cp.asarray(q_start),
            cp.asarray(q_lens), cp.asarray(kv_lens), kp, vp, 0, KVH, D ** -0.5)
    outs = {}
    most_heads = dict(fp.WGMMA_MAX_HEADS)
    for most in (1, 2):  # one head a block; the most (max_keys below SHARE_MIN_KEYS: one head a block)
        monkeypatch.setattr(fp, "WGMMA_MAX_HEADS", most_heads if most == 2 else dict.fromkeys(most_heads, 1))
        assert fp.use_wgmma(D, 0) == (kernel == "wgmma")
        outs[most] = cp.full((T, H, D), np.nan, np.float16)
        fp.flash_prefill(*args, outs[most], window, kv_fp8=kv8, max_keys=fp.SHARE_MIN_KEYS * (most - 1))
    np.testing.assert_array_equal(cp.asnumpy(outs[2]), cp.asnumpy(outs[1]))
    longer = (cp.asarray(np.concatenate([tile_seq, tile_seq[:2]])), cp.asarray(np.concatenate([tile_q0, tile_q0[:2]])))
    on_device = (args[0], *longer, *args[3:])
    if kernel == "mma":
        with pytest.raises(ValueError, match="tiles_on_device"):
            fp.flash_prefill(*on_device, outs[1], window, kv_fp8=kv8, tiles_on_device=cp.zeros(1, np.int32))
    else:
        s_last, q0_last = int(tile_seq[-1]), int(tile_q0[-1])  # the tile with the fewest keys
        unrun = np.zeros(T, bool)
        unrun[q_start[s_last] + q0_last:q_start[s_last] + min(q0_last + fp.BLOCK_M, q_lens[s_last])] = True
        for count in (len(tile_seq), len(tile_seq) - 1):
            got = cp.full((T, H, D), np.nan, np.float16)
            fp.flash_prefill(*on_device, got, window, kv_fp8=kv8, tiles_on_device=cp.asarray([count], np.int32))
            got = cp.asnumpy(got)
            if count < len(tile_seq):
                assert np.isnan(got[unrun]).all()
                np.testing.assert_array_equal(got[~unrun], cp.asnumpy(outs[1])[~unrun])
            else:
                np.testing.assert_array_equal(got, cp.asnumpy(outs[1]))
    if kernel == "wgmma":
        # three persistent blocks, each taking work items of several sequences and heads
        monkeypatch.setattr(fp, "WGMMA_MAX_BLOCKS", 3)
        few = cp.full((T, H, D), np.nan, np.float16)
        fp.flash_prefill(*args, few, window, kv_fp8=kv8)
        np.testing.assert_array_equal(cp.asnumpy(few), cp.asnumpy(outs[1]))
        # more items a block than its table holds: flash_prefill.cu takes the launch
        built, module = [], fp.module
        monkeypatch.setattr(fp, "module", lambda family, **kw: built.append(family) or module(family, **kw))
        monkeypatch.setattr(fp, "WGMMA_ITEM_CAP", 2)
        fallback = cp.full((T, H, D), np.nan, np.float16)
        fp.flash_prefill(*args, fallback, window, kv_fp8=kv8)
        assert built[-1] == "flash_prefill"
        np.testing.assert_array_equal(cp.asnumpy(fallback), cp.asnumpy(outs[1]))
        # flash_prefill.cu's bits: the same products, sums and softmax in the same order
        monkeypatch.setattr(fp, "WGMMA", False)
        mma = cp.full((T, H, D), np.nan, np.float16)
        fp.flash_prefill(*args, mma, window, kv_fp8=kv8)
        np.testing.assert_array_equal(cp.asnumpy(mma), cp.asnumpy(outs[1]))
    got = cp.asnumpy(outs[2]).astype(np.float64)
    qr = rounded(q, "float16").astype(np.float64)
    for s in range(S):
        for i in range(q_lens[s]):
            pos, t = starts[s] + i, q_start[s] + i
            first = max(0, pos + 1 - window) if window else 0
            k, v = kv[0, s, first:pos + 1].astype(np.float64), kv[1, s, first:pos + 1].astype(np.float64)
            for h in range(H):
                sc = k[:, h // (H // KVH)] @ qr[t, h] * D ** -0.5
                p = np.exp(sc - sc.max())
                ref = p @ v[:, h // (H // KVH)] / p.sum()
                np.testing.assert_allclose(got[t, h], ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


def random_codes(shape, sparse: bool = False) -> np.ndarray:
    """e4m3 codes of random values (no NaN codes); sparse: 0 or +-1 with 1 in 5 nonzero, so
    that every sum of products is a small integer, exact in any order and in bfloat16."""
    if sparse:
        return np.array([0x00, 0x38, 0xB8], np.uint8)[rng.integers(0, 3, shape) * (rng.random(shape) < 0.2)]
    return (rng.integers(0, 0x7E, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)


# gemm_fp8.cu configurations (WgmmaConfig fields: bt, rm, cw, splits, stages, kbox, min_blocks,
# tsplit): each token tile (16-256), 1-2 warpgroups of 1-7 m64 tiles, K split over a cluster,
# two slices of K a stage, two blocks an SM, warpgroups halving the tokens
WGMMA_CONFIGS = [(16, 1, 1, 4, 4, 1, 1), (32, 1, 1, 1, 4, 2, 1), (32, 1, 1, 3, 4, 2, 2),
                 (64, 2, 2, 1, 3, 1, 1), (128, 1, 1, 2, 4, 1, 2), (256, 1, 2, 2, 3, 1, 1),
                 (64, 7, 2, 1, 3, 1, 1, 2), (256, 1, 2, 2, 5, 1, 1, 2)]


@pytest.mark.parametrize("fields", WGMMA_CONFIGS, ids=lambda f: "-".join(map(str, f)))
def test_gemm_fp8_wgmma(fields):
    """gemm_fp8.cu, the fp8 product on wgmma (sm_90a), two token tiles of which the second is
    partial: sparse codes give integer sums, which must come out exact (float32 and bfloat16);
    random codes stay within the unpromoted MMA sums' drift from the exact ones (as cuBLASLt's
    fast accumulation), and the bfloat16 output is the float32 one rounded. Rows past M are
    not written."""
    from kernels_cuda import gemm as G
    from kernels_cuda.quant import Fp8Matrix
    if not G.wgmma_supported():
        pytest.skip("gemm_fp8.cu needs an sm_90 GPU")
    config = G.WgmmaConfig(*fields)
    M, N, K = 2 * config.bt - 5, 2 * config.bmw, 3 * 128 * config.kbox * config.splits
    assert config.fits(M, N, K)
    for sparse in (True, False):
        xq, wq = random_codes((M, K), sparse), random_codes((N, K), sparse)
        w = Fp8Matrix(cp.asarray(wq), cp.ones(N, np.float32))
        ref = E4M3[xq].astype(np.float64) @ E4M3[wq].T.astype(np.float64)
        outs = []
        for dtype in (np.float32, np.uint16):
            buf = cp.full((M + 3, N), 12345, dtype)
            G.gemm_fp8_wgmma(cp.asarray(xq), w, buf[:M], config)
            assert bool((buf[M:] == 12345).all())
            outs.append(from_dev(buf[:M]))
        out32, out16 = outs
        if sparse:
            np.testing.assert_array_equal(out32, ref)
            np.testing.assert_array_equal(out16, ref)
        else:
            assert float(np.sqrt(((out32 - ref) ** 2).mean() / (ref ** 2).mean())) < 1e-2
            np.testing.assert_array_equal(out16, rounded(out32, "bfloat16"))


def test_tuned_wgmma_product_serves_gemm_fp8(monkeypatch):
    """tune_gemm_fp8_wgmma times cuBLASLt and the bucket's gemm_fp8.cu candidates as captured
    graphs and, when one wins (here whatever its gain), gemm_fp8 with fast accumulation runs it for
    every row count of the bucket, in the bits of gemm_fp8_wgmma; promoted sums stay on
    cuBLASLt."""
    from kernels_cuda import gemm as G
    from kernels_cuda.quant import Fp8Matrix
    if not G.wgmma_supported():
        pytest.skip("gemm_fp8.cu needs an sm_90 GPU")
    monkeypatch.setattr(G, "TUNE_MIN_GAIN", -1.0)
    monkeypatch.setattr(G, "_wgmma_plans", {})
    monkeypatch.setattr(G, "WGMMA_CANDIDATES", {64: [(64, 1, 1, 1, 4, 1, 1), (64, 1, 1, 2, 4, 1, 2)]})
    K, N = 1024, 512
    ws = [Fp8Matrix(cp.asarray(random_codes((N, K))), cp.ones(N, np.float32)) for _ in range(3)]
    xq = cp.asarray(random_codes((64, K)))
    lt_us, times, config = G.tune_gemm_fp8_wgmma(xq, ws, cp.zeros((64, N), np.uint16), cp.cuda.Stream(), pdl=True)
    assert lt_us > 0 and len(times) == 2 and config is not None and times[config] == min(times.values())
    for M in (40, 64):
        got = G.gemm_fp8(xq[:M], ws[1], cp.zeros((M, N), np.uint16), fast_accum=True)
        want = G.gemm_fp8_wgmma(xq[:M], ws[1], cp.zeros((M, N), np.uint16), config)
        np.testing.assert_array_equal(cp.asnumpy(got), cp.asnumpy(want))

    def refuse(*args, **kwargs):
        raise AssertionError("promoted sums ran on gemm_fp8.cu")

    monkeypatch.setattr(G, "_launch_wgmma", refuse)
    G.gemm_fp8(xq, ws[1], cp.zeros((64, N), np.uint16), fast_accum=False)


def test_tuned_fp8_choices_by_exact_rows(monkeypatch):
    """A choice made for exactly M rows (gemm._Lt.choose, gemm._wgmma_plans) stays M's: the 64-row
    bucket's choice, made after one for 48 rows, does not replace it, and serves the bucket's row
    counts that nothing was chosen for (40, and 56 planned later), as a 200-row ragged step takes
    the 256-row graph's while the 160-224-row graphs keep their own. Each product still runs."""
    from kernels_cuda import gemm as G
    from kernels_cuda.quant import Fp8Matrix
    lt = G._lt_handle()
    K, N, f32 = 1024, 768, G.CUDA_R_32F
    w = Fp8Matrix(cp.asarray(random_codes((N, K))), cp.ones(N, np.float32))
    xq = cp.asarray(random_codes((64, K)))
    for M in (40, 48, 64):
        G.gemm_fp8(xq[:M], w, cp.zeros((M, N), np.float32), True)
    plan = lt.plans[(64, N, K, f32, True, False)]
    candidates = lt._heuristic(*plan[:4], 64, N, K, count=8)
    if len({bytes(c) for c in candidates}) < 2:
        pytest.skip("cuBLASLt offers one algorithm for this shape")
    mine, bucket = candidates[0], next(c for c in candidates if bytes(c) != bytes(candidates[0]))
    monkeypatch.setattr(lt, "tuned", {})
    monkeypatch.setattr(lt, "algos", dict(lt.algos))
    lt.choose(48, N, K, f32, True, mine)
    lt.choose(64, N, K, f32, True, bucket)
    G.gemm_fp8(xq[:56], w, cp.zeros((56, N), np.float32), True)
    algo = {M: bytes(lt.plans[(M, N, K, f32, True, False)][4]) for M in (40, 48, 56, 64)}
    assert algo == {40: bytes(bucket), 48: bytes(mine), 56: bytes(bucket), 64: bytes(bucket)}
    for M in (40, 48, 56, 64):
        got = cp.asnumpy(G.gemm_fp8(xq[:M], w, cp.zeros((M, N), np.float32), True))
        assert np.isfinite(got).all() and np.abs(got).max() > 0
    config = G.WgmmaConfig()
    monkeypatch.setattr(G, "_wgmma_plans", {(64, N, K, f32): config, (48, N, K, f32): None})
    assert [G._wgmma_plan(M, N, K, f32) for M in (40, 48, 64)] == [config, None, config]


@pytest.mark.parametrize("fast", [False, True])
def test_tuned_fp8_product_algorithm(monkeypatch, fast):
    """tune_gemm_fp8 times the heuristic's algorithms over several matrices and keeps the
    fastest (here whatever its gain) for the shape's bucket of rows: the products of every row
    count in that bucket then run it, plans made before included, with the sums they had
    (the same values; another algorithm may add in another order). So does each other
    candidate the heuristic offers."""
    from kernels_cuda import gemm as G
    from kernels_cuda.quant import quantize_matrix, quantize_rows
    monkeypatch.setattr(G, "TUNE_MIN_GAIN", -1.0)
    K, N = 2048, 1024
    ws = [quantize_matrix(to_dev(rng.standard_normal((N, K)).astype(np.float32) * 0.05, "float16")) for _ in range(3)]
    xq, _ = quantize_rows(to_dev(rng.standard_normal((64, K)).astype(np.float32), "float16"))
    before = {M: cp.asnumpy(G.gemm_fp8(xq[:M], ws[1], cp.zeros((M, N), np.float32), fast)) for M in (40, 64)}
    out64 = cp.zeros((64, N), np.float32)
    times, used = G.tune_gemm_fp8(xq, ws, out64, fast)
    assert np.isfinite(min(times)) and min(times) > 0 and times[used] == min(times)
    # timed now for exactly 64 rows (a runner built next takes this choice: CudaRunner._tune_products)
    assert G.fp8_tuned(xq, ws[0], out64, fast) and not G.fp8_tuned(xq[:40], ws[0], out64[:40], fast)
    bucket = (64, N, K, G.CUDA_R_32F, fast, False)  # (rows, N, K, out type, fast, scaled in the epilogue)
    plan = G._lt.plans[bucket]
    candidates = G._lt._heuristic(*plan[:4], 64, N, K, count=8)
    assert bytes(G._lt.algos[bucket]) == bytes(candidates[int(np.argmin(times))])
    for algo in candidates:
        G._lt.choose(64, N, K, G.CUDA_R_32F, fast, algo)
        for M in (40, 64):  # 40: a plan made before the tuning
            assert bytes(G._lt.plans[(M, N, K, G.CUDA_R_32F, fast, False)][4]) == bytes(algo)
            after = cp.asnumpy(G.gemm_fp8(xq[:M], ws[1], cp.zeros((M, N), np.float32), fast))
            tol = 1e-2 if fast else 1e-3  # unpromoted sums: each algorithm's order drifts its own way
            np.testing.assert_allclose(after, before[M], rtol=tol, atol=tol * np.abs(before[M]).max())


@pytest.mark.parametrize("P", [3, 12])
def test_products_add_a_delta_in_parts(P):
    """A delta in parts (attn_block's o product, a part per KV head; mlp_block's down product,
    12 parts for SmolLM2, loaded 8 at a time; the parts apart in a larger buffer) is added
    part by part: the bits of the parts summed in order first, through add_rms_norm and
    through a product's folded norm."""
    from kernels_cuda.gemv import NormIn, gemv_silu
    from kernels_cuda.rmsnorm import add_rms_norm
    B, K = 3, 576
    res = cp.asarray(rng.standard_normal((B, K)).astype(np.float32))
    store = cp.asarray(rng.standard_normal((P, 16, K)).astype(np.float32))
    parts = store[:, :B]
    summed_delta = parts[0].copy()
    for p in range(1, P):
        summed_delta = summed_delta + parts[p]
    weight = cp.asarray(rng.uniform(0.5, 1.5, K).astype(np.float32))
    bias = cp.asarray(rng.standard_normal(K).astype(np.float32))
    outs = []
    for delta in (summed_delta, parts):
        r, normed = res.copy(), cp.zeros((B, K), np.float16)
        add_rms_norm(r, delta, weight, 1e-5, out=normed, bias=bias)
        outs.append((cp.asnumpy(r), cp.asnumpy(normed)))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    w = cp.asarray((rng.standard_normal((64, K)) * 0.1).astype(np.float16))
    x = cp.zeros((1, K), np.float16)
    acts = [gemv_silu(x, w, cp.zeros((1, 32), np.float16),
                      norm=NormIn(res[:1], weight, 1e-5, delta, bias, cp.zeros((1, K), np.float32)))
            for delta in (summed_delta[:1], store[:, :1])]
    np.testing.assert_array_equal(cp.asnumpy(acts[0]), cp.asnumpy(acts[1]))
    with pytest.raises(ValueError, match="contiguously"):
        add_rms_norm(res[:, :K - 4].copy(), store[:, :B, :K - 4], weight[:K - 4], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 576, 1536), (128, 192, 256)], ids=["smollm2", "small"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_mlp_block(dtype, shape, with_bias):
    """The layer's second half in one kernel against float64 (rounded where the kernel stores
    16 bits): res + attn o (+ bias) to res_out, its RMSNorm, gate/up, SiLU * up, down in parts
    whose sum is the product; 16 rows, and each row alone gives the same bits (batch
    invariance). Every part and res_out element is written (NaN before)."""
    from kernels_cuda.mlp_block import (
        MAX_ROWS,
        down_blocks,
        mlp_block,
        parts,
        supported,
    )
    hidden, qw, inter = shape
    assert supported(hidden, qw, inter)
    B, P = MAX_ROWS, parts(inter)
    res = rng.standard_normal((B, hidden)).astype(np.float32)
    attn = rounded(rng.standard_normal((B, qw)).astype(np.float32), dtype)
    w_o = rounded(rng.standard_normal((hidden, qw)).astype(np.float32) / np.sqrt(qw), dtype)
    w_gu = rounded(rng.standard_normal((2 * inter, hidden)).astype(np.float32) / np.sqrt(hidden), dtype)
    w_d = rounded(rng.standard_normal((hidden, inter)).astype(np.float32) / np.sqrt(inter), dtype)
    norm_w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    bias = rng.standard_normal(hidden).astype(np.float32) * 0.1 if with_bias else None
    dev = {"w_o": to_dev(w_o, dtype), "w_gu": to_dev(w_gu, dtype), "w_d": down_blocks(to_dev(w_d, dtype))}

    def run(rows):
        n = len(rows)
        store = cp.full((P, MAX_ROWS + 3, hidden), np.nan, np.float32)  # parts apart, as the runner's
        res_out = cp.full((n, hidden), np.nan, np.float32)
        mlp_block(cp.asarray(res[rows]), to_dev(attn[rows], dtype), dev["w_o"],
                  cp.asarray(bias) if with_bias else None, cp.asarray(norm_w), 1e-5, res_out, dev["w_gu"], dev["w_d"],
                  store[:, :n])
        return cp.asnumpy(store[:, :n]), cp.asnumpy(res_out)

    got_parts, res_out = run(np.arange(B))
    assert np.isfinite(got_parts).all() and np.isfinite(res_out).all()
    for b in (0, 7, 15):  # each row alone: the same bits
        alone = run(np.array([b]))
        np.testing.assert_array_equal(alone[0][:, 0], got_parts[:, b])
        np.testing.assert_array_equal(alone[1][0], res_out[b])
    h = res + attn.astype(np.float64) @ w_o.T.astype(np.float64) + (bias if with_bias else 0)
    np.testing.assert_allclose(res_out, h, rtol=1e-5, atol=1e-4)
    x = rounded((h / np.sqrt((h * h).mean(1, keepdims=True) + 1e-5) * norm_w).astype(np.float32), dtype)
    gu = x.astype(np.float64) @ w_gu.T.astype(np.float64)
    g, u = gu[:, :inter], gu[:, inter:]
    a = rounded((g / (1 + np.exp(-g)) * u).astype(np.float32), dtype).astype(np.float64)
    ref = a @ w_d.T.astype(np.float64)
    summed = got_parts[0].astype(np.float64)
    for p in range(1, P):
        summed = summed + got_parts[p]
    assert rel(summed, ref) < (2e-2 if dtype == "bfloat16" else 3e-3)
    with pytest.raises(ValueError, match="res_out"):
        r = cp.asarray(res[:1])
        mlp_block(r, to_dev(attn[:1], dtype), dev["w_o"], None, cp.asarray(norm_w), 1e-5, r, dev["w_gu"],
                  dev["w_d"], cp.zeros((P, 1, hidden), np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("shape", [(576, 9, 3, 64), (96, 6, 2, 16), (128, 2, 1, 64)],
                         ids=["smollm2", "gqa3-hd16", "gqa2-hd64"])
@pytest.mark.parametrize("window", [0, 300])
def test_attn_o(dtype, kv8, shape, window):
    """Attention and the o product in one kernel against float64: rows of 1 to 1,200 cached keys
    (the token's own the last: up to 19 64-key tiles, the own key in the first, the second and a
    later tile; a padding row), o in a part per KV head; each row's bits do not depend on the
    other rows. The cache is only read."""
    from kernels_cuda.attn_o import attn_o, supported
    hidden, H, KVH, D = shape
    if kv8 and D % 32:
        pytest.skip("the fp8 decode attention takes head dims of multiples of 32")
    assert supported(hidden, H, KVH, D, kv8)
    G, region = H // KVH, 1280
    lens = np.array([1, 70, 0, 700, 1200, 100], np.int32)
    B = len(lens)
    q = rounded(rng.standard_normal((B, H, D)).astype(np.float32), dtype)
    w_o = rounded(rng.standard_normal((hidden, H * D)).astype(np.float32) / np.sqrt(H * D), dtype)
    kv, kp, vp, pool = kv_cache_rows(kv8, B, region, KVH, D, dtype)
    pool_before = cp.asnumpy(pool)
    dq, dw = to_dev(q, dtype), to_dev(w_o, dtype)

    def run(rows):
        n = len(rows)
        store = cp.full((KVH, 8, hidden), np.nan, np.float32)  # parts apart, as the runner's
        attn = cp.zeros((n, H, D), dq.dtype)
        attn_o(dq[rows], dw, kp[rows], vp[rows], cp.asarray(lens[rows]), 0, KVH, attn, store[:, :n], D ** -0.5,
               window=window, kv_fp8=kv8)
        return cp.asnumpy(store[:, :n]), from_dev(attn)

    parts, attn_rows = run(np.arange(B))
    assert np.isnan(parts[:, 2]).all()  # the padding row is left alone
    for b in (4, 1):  # each row alone: the same bits
        np.testing.assert_array_equal(run(np.array([b]))[0][:, 0], parts[:, b])
    np.testing.assert_array_equal(cp.asnumpy(pool), pool_before)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        for g in range(KVH):
            attn = np.stack([attend_f64(kv, b, n, window, g, q[b, g * G + j], D ** -0.5) for j in range(G)])
            assert rel(attn_rows[b, g * G:(g + 1) * G], attn) < (2e-2 if dtype == "bfloat16" else 3e-3), (b, g)
            ref = w_o[:, g * G * D:(g + 1) * G * D].astype(np.float64) @ attn.reshape(-1)
            assert rel(parts[g, b], ref) < (3e-2 if dtype == "bfloat16" else 5e-3), (b, g)
    with pytest.raises(ValueError, match="out_parts"):
        attn_o(dq, dw, kp, vp, cp.asarray(lens), 0, KVH, cp.zeros((B, H, D), dq.dtype),
               cp.zeros((KVH + 1, B, hidden), np.float32), D ** -0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv8", [False, True], ids=["kv16", "kv8"])
@pytest.mark.parametrize("shape", [(576, 9, 3, 64), (96, 6, 2, 16), (128, 2, 1, 64)],
                         ids=["smollm2", "gqa3-hd16", "gqa2-hd64"])
@pytest.mark.parametrize("window,with_bias", [(0, False), (300, True)])
def test_attn_block(dtype, kv8, shape, window, with_bias):
    """The attention block in one kernel against float64: RMSNorm(res + delta), QKV (+ bias),
    RoPE, the token's K/V row written to the cache, attention over the cached keys and the
    token's (rows of 1 to 1,200 keys: up to three 64-key tiles a block, the token's key in
    a tile after the first two; a padding row), and o in a part per KV head. The residual
    sum goes to res_out; each row's bits do not depend on the other rows."""
    from kernels_cuda.attn_block import attn_block, supported
    from kernels_cuda.gemv import NormIn
    hidden, H, KVH, D = shape
    if kv8 and D % 16:
        pytest.skip("e4m3 K/V rows of whole 16-byte pieces")
    assert supported(hidden, H, KVH, D, kv8)
    G, region = H // KVH, 1280
    lens = np.array([1, 70, 0, 700, 1200], np.int32)
    B = len(lens)
    pos = np.maximum(lens - 1, 0).astype(np.int32)
    res = rng.standard_normal((B, hidden)).astype(np.float32)
    delta = rng.standard_normal((B, hidden)).astype(np.float32)
    norm_w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
    w_qkv = rounded(rng.standard_normal(((H + 2 * KVH) * D, hidden)).astype(np.float32) / np.sqrt(hidden), dtype)
    w_o = rounded(rng.standard_normal((hidden, H * D)).astype(np.float32) / np.sqrt(H * D), dtype)
    bias = rng.standard_normal(w_qkv.shape[0]).astype(np.float32) * 0.1 if with_bias else None
    inv = 1.0 / 10000 ** (np.arange(0, D, 2) / D)
    ang = np.arange(region)[:, None] * inv[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    _, kp, vp, pool = kv_cache_rows(kv8, B, region, KVH, D, dtype)
    pool_before = cp.asnumpy(pool)
    args = {"w_qkv": to_dev(w_qkv, dtype), "w_o": to_dev(w_o, dtype), "cos": cp.asarray(cos), "sin": cp.asarray(sin)}

    def run(rows):
        n = len(rows)
        store = cp.full((KVH, 8, hidden), np.nan, np.float32)
        res_out = cp.full((n, hidden), np.nan, np.float32)
        norm = NormIn(cp.asarray(res[rows]), cp.asarray(norm_w), 1e-5, cp.asarray(delta[rows]), None, res_out)
        attn_block(norm, args["w_qkv"], cp.asarray(bias) if with_bias else None, args["w_o"], cp.asarray(pos[rows]),
                   args["cos"], args["sin"], kp[rows], vp[rows], cp.asarray(lens[rows]), 0, H, KVH, store[:, :n],
                   D ** -0.5, window=window, kv_fp8=kv8)
        return cp.asnumpy(store[:, :n]), cp.asnumpy(res_out)

    parts, res_out = run(np.arange(B))
    np.testing.assert_array_equal(res_out[lens > 0], (res + delta)[lens > 0])
    assert np.isnan(parts[:, 2]).all()  # the padding row is left alone
    for b in (4, 1):  # each row alone: the same bits
        np.testing.assert_array_equal(run(np.array([b]))[0][:, 0], parts[:, b])
    cache = cp.asnumpy(pool).reshape(2, B, region, KVH, D)
    before = pool_before.reshape(2, B, region, KVH, D)
    stored = E4M3[cache] if kv8 else from_dev(pool).reshape(cache.shape)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        x = (res[b] + delta[b]).astype(np.float64)
        normed = rounded((x / np.sqrt((x * x).mean() + 1e-5) * norm_w).astype(np.float32), dtype).astype(np.float64)
        qkv = w_qkv.astype(np.float64) @ normed + (bias if with_bias else 0)
        heads = qkv.reshape(H + 2 * KVH, D)
        c, s = cos[pos[b]].astype(np.float64), sin[pos[b]].astype(np.float64)
        half = D // 2
        rot = np.concatenate([heads[:, :half] * c - heads[:, half:] * s, heads[:, half:] * c + heads[:, :half] * s], 1)
        q = rounded(rot[:H].astype(np.float32), dtype).astype(np.float64)
        k_new, v_new = rot[H:H + KVH], heads[H + KVH:]
        if kv8:  # the reference rounds its own normed row to 16 bits: where an element rounds the other
            # way from the kernel's, k / v move by a weight times its 16-bit step (seen: 1.3e-5, |v| <= ~2)
            noise = (1.6e-3 if dtype == "bfloat16" else 2e-4) * max(np.abs(k_new).max(), np.abs(v_new).max())
            assert_e4m3_of(cache[0, b, pos[b]], k_new.astype(np.float32), noise)
            assert_e4m3_of(cache[1, b, pos[b]], v_new.astype(np.float32), noise)
        else:
            np.testing.assert_allclose(stored[0, b, pos[b]], k_new, rtol=2e-2, atol=2e-2 * np.abs(k_new).max())
            np.testing.assert_allclose(stored[1, b, pos[b]], v_new, rtol=2e-2, atol=2e-2 * np.abs(v_new).max())
        changed = (cache[:, b] != before[:, b]).any(axis=(0, 2, 3))
        assert not changed[np.arange(region) != pos[b]].any()  # only the token's row is written
        first = max(0, n - window) if window else 0
        k, v = stored[0, b, first:n].astype(np.float64), stored[1, b, first:n].astype(np.float64)
        attn = np.zeros((H, D))
        for h in range(H):
            sc = k[:, h // G] @ q[h] * D ** -0.5
            p = np.exp(sc - sc.max())
            attn[h] = p @ v[:, h // G] / p.sum()
        for g in range(KVH):
            cols = slice(g * G * D, (g + 1) * G * D)
            ref = w_o[:, cols].astype(np.float64) @ attn[g * G:(g + 1) * G].reshape(-1)
            assert rel(parts[g, b], ref) < (3e-2 if dtype == "bfloat16" else 5e-3), (b, g)
