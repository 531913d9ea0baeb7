"""Our GGUF dequantizers against the reference semantics of gguf's `quants` module."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as ref

from engine.loader.quants import QUANT_TYPES, dequantize

# byte offsets of the fp16 scale fields in each block (random bytes there could be
# inf/nan, which would make the comparison meaningless)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    qt = QUANT_TYPES[name]
    raw = rng.integers(0, 256, size=(n_blocks, qt.block_bytes), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        scale = rng.standard_normal(n_blocks).astype(np.float16) * np.float16(0.05)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw


@pytest.mark.parametrize("name", sorted(QUANT_TYPES))
def test_quant_matches_reference(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    qt = QUANT_TYPES[name]
    rows = 7  # awkward row count; 3 blocks per row
    raw = random_blocks(name, rows * 3, rng).reshape(rows, 3 * qt.block_bytes)
    ours = dequantize(raw, name, (rows, 3 * qt.block_elems))
    theirs = ref.dequantize(raw, GGMLQuantizationType[name])
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_match_reference(name):
    rng = np.random.default_rng(0)
    values = rng.standard_normal((5, 33)).astype(np.float32)
    if name == "F32":
        raw = values.view(np.uint8)
    elif name == "F16":
        raw = values.astype(np.float16).view(np.uint8)
    else:
        raw = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    ours = dequantize(raw, name, (5, 33))
    theirs = ref.dequantize(raw, GGMLQuantizationType[name])
    np.testing.assert_array_equal(ours, np.asarray(theirs, dtype=np.float32).reshape(5, 33))


def test_quantized_values_roundtrip_q8_0():
    """A known-answer case independent of any reference: Q8_0 of integers with d=0.5."""
    raw = np.zeros((1, 34), np.uint8)
    raw[0, 0:2] = np.array([0.5], np.float16).view(np.uint8)
    raw[0, 2:34] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(dequantize(raw, "Q8_0", (32,)), np.arange(-16, 16) * 0.5)


def test_unsupported_type_names_itself():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XXS", (256,))
