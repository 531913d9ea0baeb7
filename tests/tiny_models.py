"""Tiny random Llama / Mistral / Qwen2 checkpoints made with transformers, for tests."""

from __future__ import annotations

from pathlib import Path

VOCAB = 384

# name -> (config class name, model class name, config overrides)
TINY_SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    )),
    "llama_tied_mha": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=6)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, num_attention_heads=6,
                                                      hidden_size=96)),
    # head dims of real models (the fp8 K/V decode kernel takes multiples of 32)
    "llama_hd64": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=128, num_attention_heads=2,
                                                           num_key_value_heads=1)),
    "mistral_hd32": ("MistralConfig", "MistralForCausalLM", dict(num_attention_heads=2, num_key_value_heads=1,
                                                               sliding_window=6)),
}


def build_tiny_model(directory: Path, name: str, seed: int = 0, config: dict | None = None, dtype: str | None = None,
                     **save_kwargs) -> Path:
    """TINY_SPECS[name] with its weights drawn from `seed`; config: further config overrides;
    dtype: the torch dtype to save the weights in (float32 if None)."""
    import torch
    import transformers

    cfg_cls, model_cls, overrides = TINY_SPECS[name]
    params = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                  eos_token_id=2)
    params.update(overrides)
    params.update(config or {})
    config = getattr(transformers, cfg_cls)(**params)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random biases and norms too, so every weight matters
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "norm" in pname:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in pname else 0.0))
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    out = directory / (name if dtype is None else f"{name}_{dtype}")
    model.save_pretrained(out, **save_kwargs)
    return out


def build_tiny_models(directory: Path) -> dict[str, Path]:
    return {name: build_tiny_model(directory, name, seed=i) for i, name in enumerate(TINY_SPECS)}
