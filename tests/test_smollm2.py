"""The real model: SmolLM2-135M-Instruct Q4_1 against llama.cpp's reference data
(tests/data/llamacpp_smollm2.json, made by tools/make_llamacpp_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.runner_helpers import prefill_step

DATA = json.loads((Path(__file__).parent / "data" / "llamacpp_smollm2.json").read_text(encoding="utf-8"))

ROUNDTRIP_TEXTS = [
    "Plain ASCII, punctuation; and (brackets) [with] {braces}!?",
    "Emoji 😀🎉🧑‍🚀👍🏽 and ZWJ families 👨‍👩‍👧‍👦",
    "CJK: 東京は日本の首都です。中文，한국어 텍스트",
    "Accents: àéîõü ÀÉÎÕÜ ñ ç ß œ Ø å, Vietnamese: Tiếng Việt có dấu",
    "code:\n\tif (x != y) { return a->b[i] << 2; }\n    # comment λ => x * 2\n",
    "Whitespace   runs\t\ttabs\n\n\nnewlines  \r\n  end  ",
    "Math ∑∫√∞≠≤≥ and Greek αβγδ and arrows ←↑→↓ and ≈ symbols",
    "RTL: مرحبا بالعالم and Hebrew שלום עולם",
]


def test_model_config(smollm2):
    cfg = smollm2.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == \
        ("llama", 576, 30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.dtype == "q4_1" and cfg.eos_token_ids == (2,)
    assert smollm2.tokenizer.chat_template and "<|im_start|>" in smollm2.tokenizer.chat_template


@pytest.mark.parametrize("case", DATA["tokenize"], ids=lambda c: c["text"][:24])
def test_token_ids_match_llama_cpp(smollm2, case):
    assert smollm2.tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"]


@pytest.mark.parametrize("text", ROUNDTRIP_TEXTS + [c["text"] for c in DATA["tokenize"]])
def test_tokenizer_round_trips(smollm2, text):
    tok = smollm2.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes[i] for i in ids).decode("utf-8") == text


def test_teacher_forced_top1_agrees_with_llama_cpp(smollm2, smollm2_runner):
    teacher = DATA["teacher"]
    ids = teacher["ids"]
    assert smollm2.tokenizer.encode(teacher["text"], add_special_tokens=False) == ids
    assert len(ids) >= 150
    logits = smollm2_runner.forward(prefill_step([ids]), all_logits=True)
    ref_top1 = np.array([top[0] for top in teacher["top_ids"]])
    agreement = float((logits.argmax(axis=1) == ref_top1).mean())
    assert agreement >= 0.95, agreement
    # where llama.cpp is confident, we pick its token among our top 5
    ours_top5 = np.argsort(-logits, axis=1)[:, :5]
    assert all(ref_top1[i] in ours_top5[i] for i in range(len(ids)))


def test_greedy_paris(smollm2_path):
    from engine import LLM, SamplingParams
    llm = LLM(smollm2_path, device="cpu", max_model_len=512)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")
    # LLM.chat: the chat template's prompt, as the server renders it (one conversation, or a list of them)
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    one = llm.chat(question, greedy, use_tqdm=False)
    both = llm.chat([question, [{"role": "user", "content": "Say hi."}]], greedy, use_tqdm=False)
    assert "Paris" in one[0].outputs[0].text and len(both) == 2
    assert both[0].outputs[0].text == one[0].outputs[0].text
    rendered = llm.tokenizer.apply_chat_template(question, add_generation_prompt=True)
    assert one[0].prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
