"""The NumPy runner's logits against transformers (torch, CPU) on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest

from engine.loader import load_model
from engine.runner.numpy_runner import NumpyRunner
from tests.runner_helpers import REGION, decode_step, prefill_step, rel_err
from tests.tiny_models import TINY_SPECS, VOCAB, build_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
DECODE_STEPS = 8


def hf_logits(path, sequences: list[list[int]]) -> list[np.ndarray]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(torch.tensor([s])).logits[0].numpy() for s in sequences]


def run_ragged(path, prompts, continuations):
    """Our logits: one ragged prefill of all prompts, then batched teacher-forced decodes."""
    model = load_model(str(path), with_tokenizer=False)
    runner = NumpyRunner(model.config, model.weights, num_kv_slots=REGION * len(prompts),
                         max_model_len=REGION, progress=False)
    prefill = runner.forward(prefill_step(prompts), all_logits=True)
    decodes = []
    positions = [len(p) for p in prompts]
    for step in range(DECODE_STEPS):
        tokens = [c[step] for c in continuations]
        decodes.append(runner.forward(decode_step(tokens, positions)))
        positions = [p + 1 for p in positions]
    return prefill, decodes


@pytest.mark.parametrize("name", sorted(TINY_SPECS))
def test_logits_match_transformers(tiny_models, name):
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in (5, 17, 11)]  # ragged
    continuations = [rng.integers(0, VOCAB, DECODE_STEPS).tolist() for _ in prompts]
    refs = hf_logits(tiny_models[name], [p + c for p, c in zip(prompts, continuations)])
    prefill, decodes = run_ragged(tiny_models[name], prompts, continuations)

    offset = 0
    for p, ref in zip(prompts, refs):
        assert rel_err(prefill[offset:offset + len(p)], ref[:len(p)]) <= TOL
        offset += len(p)
    for step, logits in enumerate(decodes):
        for row, (p, ref) in enumerate(zip(prompts, refs)):
            assert rel_err(logits[row], ref[len(p) + step]) <= TOL, (name, step, row)


def test_sharded_bf16_checkpoint_loads_exactly(tmp_path):
    """A bf16 checkpoint split over several safetensors files: every tensor equals
    torch's bf16 -> fp32 conversion, and logits match the model upcast to fp32."""
    path = build_tiny_model(tmp_path, "llama", seed=3)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()

    loaded = load_model(str(sharded), with_tokenizer=False)
    assert loaded.config.dtype == "bfloat16"
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    for name, value in state.items():
        np.testing.assert_array_equal(loaded.weights[name], value, err_msg=name)

    ids = [3, 14, 15, 92, 65, 35]
    runner = NumpyRunner(loaded.config, loaded.weights, num_kv_slots=64, max_model_len=64, progress=False)
    ours = runner.forward(prefill_step([ids]), all_logits=True)
    with torch.no_grad():
        ref = model.float()(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(ours, ref) <= TOL


def test_unsupported_architecture_is_named(tmp_path):
    import json
    path = build_tiny_model(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        load_model(str(path), with_tokenizer=False)
