"""Make tests/data/llamacpp_smollm2.json: llama.cpp's token ids and logits for SmolLM2.

Run once, in an environment with llama-cpp-python (CPU build), not in CI:

    python -m venv /tmp/llamaenv && /tmp/llamaenv/bin/pip install llama-cpp-python numpy
    /tmp/llamaenv/bin/python tools/make_llamacpp_reference.py path/to/SmolLM2-135M-Instruct.Q4_1.gguf

The tests compare against the committed JSON and need no llama.cpp.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "llamacpp_smollm2.json"

# Prompts whose token ids must match llama.cpp's exactly.
TOKENIZE_PROMPTS = [
    "The capital of France is",
    "Hello, world! How are you today?",
    "  leading spaces and trailing   ",
    "I can't believe it's not butter; they'll say we'd've known.",
    "Numbers: 0 7 42 1234567 3.14159 -12e-5 1,000,000",
    "Emoji: 🎉🚀👩‍💻 and flags 🇫🇷🇯🇵",
    "中文分词测试：你好，世界！日本語のテキストも。한국어 문장.",
    "Accents: café, naïve, résumé, Zürich, São Paulo, Ærø, Ångström",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\nnewlines\n\n\nand \r\n windows line ends",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "MiXeD CaSe WORDS and snake_case_identifiers and camelCaseToo",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "Ω≈ç√∫˜µ≤≥÷ ∑∏π ∆ ∂ ∞ ≠ ≡",
]

# Text for teacher-forced next-token agreement (over 150 positions).
TEACHER_TEXT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain in a few sentences why the sky is blue.<|im_end|>\n"
    "<|im_start|>assistant\nThe sky looks blue because of the way sunlight interacts with the "
    "atmosphere. Sunlight contains all colors of visible light. When it enters the atmosphere, it "
    "collides with gas molecules, which scatter shorter wavelengths much more strongly than longer "
    "ones. Blue light has a short wavelength, so it is scattered in every direction and reaches our "
    "eyes from all parts of the sky. This effect is called Rayleigh scattering. At sunrise and "
    "sunset, light travels through more air, so most of the blue is scattered away and the sky "
    "turns red and orange.<|im_end|>\n"
    "<|im_start|>user\nWrite a Python function that returns the sum of a list.<|im_end|>\n"
    "<|im_start|>assistant\nHere is a simple function:\n\ndef total(values):\n    result = 0\n"
    "    for value in values:\n        result += value\n    return result\n\nYou can call it as "
    "total([1, 2, 3]), which returns 6.<|im_end|>\n"
)

TOP_K = 5


def main() -> None:
    model_path = sys.argv[1]
    llm = Llama(model_path=model_path, n_ctx=1024, logits_all=True, verbose=False, n_threads=2, seed=0)
    tokenize = [
        {"text": text, "ids": llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)}
        for text in TOKENIZE_PROMPTS
    ]
    ids = llm.tokenize(TEACHER_TEXT.encode("utf-8"), add_bos=False, special=True)
    llm.reset()
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)], dtype=np.float32)  # (positions, vocab) logits
    top = np.argsort(-scores, axis=1)[:, :TOP_K]
    data = {
        "generator": f"tools/make_llamacpp_reference.py, llama-cpp-python {__version__} (CPU)",
        "model": Path(model_path).name,
        "tokenize": tokenize,
        "teacher": {
            "text": TEACHER_TEXT,
            "ids": ids,
            "top_ids": top.tolist(),  # per position: ids of the 5 largest logits, best first
            "top_logits": np.take_along_axis(scores, top, axis=1).round(4).tolist(),
        },
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}: {len(tokenize)} tokenized prompts, {len(ids)} teacher-forced positions")


if __name__ == "__main__":
    main()
