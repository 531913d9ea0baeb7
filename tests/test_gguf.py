"""GGUF loading: tiny HF models written the way llama.cpp's converter writes them
(Q/K rows permuted, rope_freqs for llama3 scaling), then read back and compared."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from engine.config import ModelConfig
from engine.loader import load_model
from engine.loader.safetensors import read_weights
from engine.loader.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, tokenizer_from_gguf
from engine.runner.numpy_runner import NumpyRunner
from tests.runner_helpers import prefill_step, rel_err
from tests.test_hf_parity import hf_logits
from tests.tiny_models import VOCAB

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The converter's permutation: HF's rotate-half rows -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(n: int) -> tuple[list[str], list[str]]:
    from engine.loader.tokenizer import _byte_level_alphabet
    tokens = list(_byte_level_alphabet())  # 256 single-byte tokens
    merges = []
    for a, b in [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r")]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens += [f"<unused{i}>" for i in range(n - len(tokens))]
    return tokens, merges


def write_gguf(path, hf_dir, arch: str, cfg: ModelConfig, qtype: GGMLQuantizationType | None = None) -> None:
    weights, _ = read_weights(str(hf_dir))
    w = GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    tokens, merges = byte_level_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([TOKEN_CONTROL if t.startswith("<|") else TOKEN_NORMAL for t in tokens])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    if cfg.rope_scaling is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        plain = ModelConfig(**{**cfg.__dict__, "rope_scaling": None})
        factors = np.array(plain.rope_inv_freq()) / np.array(cfg.rope_inv_freq())
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    for name in weights:
        arr = np.ascontiguousarray(weights[name], dtype=np.float32)
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                arr = permute_like_llama_cpp(arr, cfg.num_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                arr = permute_like_llama_cpp(arr, cfg.num_kv_heads)
            gname = f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if qtype is not None and arr.ndim == 2 and arr.shape[1] % 32 == 0:
            w.add_tensor(gname, gguf_quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def our_prefill_logits(path, ids):
    model = load_model(str(path), with_tokenizer=False)
    runner = NumpyRunner(model.config, model.weights, num_kv_slots=64, max_model_len=64, progress=False)
    return model, runner.forward(prefill_step([ids]), all_logits=True)


@pytest.mark.parametrize("name,arch", [("llama", "llama"), ("llama_tied_mha", "llama"), ("qwen2", "qwen2")])
def test_f32_gguf_matches_transformers(tmp_path, tiny_models, name, arch):
    hf = load_model(str(tiny_models[name]), with_tokenizer=False)
    path = tmp_path / f"{name}.gguf"
    write_gguf(path, tiny_models[name], arch, hf.config)
    ids = np.random.default_rng(1).integers(0, VOCAB, 19).tolist()
    model, ours = our_prefill_logits(path, ids)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert model.config.qkv_bias == hf.config.qkv_bias
    assert rel_err(ours, hf_logits(tiny_models[name], [ids])[0]) <= 1e-4


def test_q8_0_gguf_is_close_to_transformers(tmp_path, tiny_models):
    hf = load_model(str(tiny_models["llama"]), with_tokenizer=False)
    path = tmp_path / "q8.gguf"
    write_gguf(path, tiny_models["llama"], "llama", hf.config, GGMLQuantizationType.Q8_0)
    ids = np.random.default_rng(2).integers(0, VOCAB, 24).tolist()
    model, ours = our_prefill_logits(path, ids)
    assert model.config.dtype == "q8_0"
    ref = hf_logits(tiny_models["llama"], [ids])[0]
    assert rel_err(ours, ref) < 0.05  # 8-bit weights: close, not exact
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.9


def test_gguf_tensors_as_stored(tmp_path, tiny_models):
    """Weights.stored gives a GGUF tensor's type and file bytes where its rows are the model's
    (the CUDA runner keeps a Q8_0 LM head so): split into codes and scales they make the values
    the loader reads; Q and K of the llama arch (rows reordered on read) and safetensors have none."""
    from engine.loader.quants import q8_0_split
    hf = load_model(str(tiny_models["llama"]), with_tokenizer=False)
    path = tmp_path / "q8.gguf"
    write_gguf(path, tiny_models["llama"], "llama", hf.config, GGMLQuantizationType.Q8_0)
    w = load_model(str(path), with_tokenizer=False).weights
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.v_proj.weight"):
        kind, raw = w.stored(name)
        assert kind == "Q8_0"
        codes, scales = q8_0_split(raw, w.shape(name))
        assert codes.dtype == np.int8 and scales.dtype == np.float16 and scales.shape[1] * 32 == codes.shape[1]
        values = codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1)
        np.testing.assert_array_equal(values, w[name])
        assert np.abs(codes).max() > 100  # a real quantization, not zeros
    assert w.stored("model.layers.0.self_attn.q_proj.weight") is None
    assert w.stored("model.layers.0.self_attn.k_proj.weight") is None
    assert w.stored("model.norm.weight")[0] == "F32"
    assert hf.weights.stored("model.embed_tokens.weight") is None
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_split(np.zeros(34, np.uint8), (2, 16))
    with pytest.raises(ValueError, match="bytes"):
        q8_0_split(np.zeros(33, np.uint8), (1, 32))


def test_gguf_tokenizer_and_template(tmp_path, tiny_models):
    hf = load_model(str(tiny_models["llama"]), with_tokenizer=False)
    path = tmp_path / "tok.gguf"
    write_gguf(path, tiny_models["llama"], "llama", hf.config)
    tok = load_model(str(path)).tokenizer
    text = "the theory in Zürich 🎉 <|im_start|> 42"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.token_to_id("<|im_start|>") in ids  # special tokens are parsed in text
    assert tok.encode(" the", add_special_tokens=False) == [tok.token_to_id("Ġthe")]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert b"".join(tok.token_bytes[i] for i in tok.encode("naïve 中文", add_special_tokens=False)) == \
        "naïve 中文".encode()


def test_gguf_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTGGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(bad))
    w = GGUFWriter(str(tmp_path / "falcon.gguf"), arch="falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon"):
        load_model(str(tmp_path / "falcon.gguf"))


def test_sentencepiece_vocabulary():
    """A GGUF 'llama' (SentencePiece) vocabulary: scores order the merges, unknown
    characters fall back to byte pieces, the leading space marker is added."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = {"▁": -1.0, "a": -2.0, "b": -2.0, "c": -2.0, "ab": -1.5, "▁a": -1.2, "▁ab": -0.5, "bc": -3.0}
    tokens += list(pieces)
    types = [TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_CONTROL] + [TOKEN_BYTE] * 256 + [TOKEN_NORMAL] * len(pieces)
    scores = [0.0] * 259 + list(pieces.values())
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_bos_token": True}
    tok = tokenizer_from_gguf(meta, eos_token_ids=[2], bos_token_id=1)
    ids = tok.encode("ab abc é")
    assert [tok.id_to_token(i) for i in ids] == ["<s>", "▁ab", "▁ab", "c", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "ab abc é"
    gen = tok.encode("ab é", add_special_tokens=False)
    assert b"".join(tok.token_bytes[i] for i in gen) == " ab é".encode()  # mid-text bytes keep the space
