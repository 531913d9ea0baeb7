"""The CPU runner's 16-bit weight kernels (cpu_kernels.c) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from engine.runner.cpu_native import W_BF16, W_F16, load_kernels, to_w16
from engine.runner.numpy_runner import NumpyRunner
from tests.runner_helpers import prefill_step


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    k = load_kernels(tmp_path_factory.mktemp("kcache"))
    if k is None:
        pytest.skip("no C compiler: the CPU runner falls back to float32")
    return k


@pytest.mark.parametrize("kind", [W_F16, W_BF16])
@pytest.mark.parametrize("M", [1, 3, 8, 11, 300])
def test_matmul_matches_numpy(kernels, kind, M):
    rng = np.random.default_rng(M)
    w = to_w16(rng.standard_normal((333, 203)).astype(np.float32), kind)  # odd K: the scalar tail runs
    x = rng.standard_normal((M, 203)).astype(np.float32)
    widened = kernels.widen(w)
    ref = x.astype(np.float64) @ widened.T.astype(np.float64)
    np.testing.assert_allclose(kernels.matmul(x, w), ref, rtol=1e-5, atol=1e-4)


def test_rows_do_not_depend_on_the_batch(kernels):
    """Each row of a product is bit-identical whether computed alone or in a batch."""
    rng = np.random.default_rng(5)
    w = to_w16(rng.standard_normal((97, 580)).astype(np.float32), W_F16)
    x = rng.standard_normal((13, 580)).astype(np.float32)
    together = kernels.matmul(x, w)
    for r in range(13):
        np.testing.assert_array_equal(kernels.matmul(x[r:r + 1], w)[0], together[r])


def test_widen_is_exact(kernels):
    values = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 6.1e-5, 5.96e-8, np.inf], np.float32)
    np.testing.assert_array_equal(kernels.widen(to_w16(values[None], W_F16))[0],
                                  values.astype(np.float16).astype(np.float32))
    bf = to_w16(values[None], W_BF16)
    np.testing.assert_array_equal(kernels.widen(bf)[0], (bf.bits.astype(np.uint32) << 16).view(np.float32)[0])


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9], np.float32)  # ties and below-half
    bits = to_w16(x[None], W_BF16).bits[0]
    assert ((bits.astype(np.uint32) << 16).view(np.float32) == np.array([1.0, 1.0 + 2**-6, 1.0])).all()


def test_16bit_smollm2_agrees_with_float32(smollm2, smollm2_runner, kernels):
    runner = NumpyRunner(smollm2.config, smollm2.weights, num_kv_slots=1024, max_model_len=512,
                         weight_dtype="float16", kernels=kernels, progress=False)
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    ref = smollm2_runner.forward(prefill_step([ids]), all_logits=True)
    ours = runner.forward(prefill_step([ids]), all_logits=True)
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.95
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 0.02
