"""Tokenizers from HF directories and GGUF metadata, and chat-template rendering.

Both sources end in a `tokenizers.Tokenizer` (the Rust backend) wrapped by
`Tokenizer`, which adds what the engine needs beyond encode/decode: BOS/EOS ids,
the chat template, and the exact bytes of every token for incremental,
UTF-8-safe detokenization.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import cached_property
from typing import Any, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits for byte-level BPE vocabularies, keyed by GGUF's
# `tokenizer.ggml.pre`. Each regex is applied in turn, keeping matches and the text
# between them as separate pieces (llama.cpp's unicode_regex_split). The regexes are
# those of the models' own tokenizer.json files.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

# name -> (regexes, ignore_merges: a whole pre-token found in the vocab is one token)
BPE_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "default": (_DEFAULT, False),
    "gpt-2": ((_GPT2,), False),
    "phi-2": ((_GPT2,), False),
    "olmo": ((_GPT2,), False),
    "llama3": ((_LLAMA3,), True),
    "llama-v3": ((_LLAMA3,), True),
    "llama-bpe": ((_LLAMA3,), True),
    "falcon3": ((_LLAMA3,), True),
    "pixtral": ((_LLAMA3,), True),
    "dbrx": ((_LLAMA3,), False),
    "smaug-bpe": ((_LLAMA3,), False),
    "qwen2": ((_QWEN2,), False),
    "deepseek-r1-qwen": ((_QWEN2,), False),
    "stablelm2": ((_QWEN2,), False),
    "megrez": ((_QWEN2,), False),
    "smollm": ((r"\p{N}", _GPT2), False),
    "starcoder": ((r"\p{N}", _GPT2), False),
    "refact": ((r"\p{N}", _GPT2), False),
    "codeshell": ((r"\p{N}", _GPT2), False),
    "tekken": ((_TEKKEN,), True),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and the chat template of a model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens marked special (dropped by skip_special_tokens)."""
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The exact bytes each token id stands for in generated text (added tokens:
        their content). Concatenating them and decoding UTF-8 gives the text."""
        return token_bytes_table(self.backend)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render `messages` with the model's Jinja chat template (HF semantics)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        return render_chat_template(
            self.chat_template,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


# ---------------------------------------------------------------------------
# token bytes


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the
    other 68 byte values are shifted to code points 256 and up. char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return {c: b for b, c in chars.items()}


def _spm_piece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("\u2581", " ").encode("utf-8")


def token_bytes_table(backend: BackendTokenizer) -> list[bytes]:
    """Bytes of every id, from the decoder's kind: byte-level BPE (GPT-2 alphabet),
    SentencePiece-style (\u2581 for spaces, <0xNN> byte pieces), else per-token decode."""
    size = backend.get_vocab_size(with_added_tokens=True)
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    added = {i: tok.content for i, tok in backend.get_added_tokens_decoder().items()}
    table: list[bytes] = []
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        for i in range(size):
            piece = added.get(i) if i in added else backend.id_to_token(i)
            if piece is None:
                table.append(b"")
            elif i in added:
                table.append(piece.encode("utf-8"))
            else:
                table.append(bytes(alphabet[c] for c in piece) if all(c in alphabet for c in piece)
                             else piece.encode("utf-8"))
        return table
    spm = "ByteFallback" in kinds or "Metaspace" in kinds
    for i in range(size):
        if i in added:
            table.append(added[i].encode("utf-8"))
            continue
        piece = backend.id_to_token(i)
        if piece is None:
            table.append(b"")
        elif spm:
            table.append(_spm_piece_bytes(piece))
        else:
            table.append(backend.decode([i], skip_special_tokens=False).encode("utf-8"))
    return table


# ---------------------------------------------------------------------------
# chat templates


class ChatTemplateError(ValueError):
    """The template raised (raise_exception) or failed to render these messages."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def compile_chat_template(source: str) -> jinja2.Template:
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not parse: {exc}") from exc
        _TEMPLATE_CACHE[source] = template
    return template


def render_chat_template(source: str, **context: Any) -> str:
    try:
        return compile_chat_template(source).render(**context)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


# ---------------------------------------------------------------------------
# HF directories


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _pick_chat_template(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def tokenizer_from_hf_dir(path: str, eos_token_ids: Sequence[int], bos_token_id: int | None) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of an HF model dir."""
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    backend = BackendTokenizer.from_file(tok_file)
    config: dict[str, Any] = {}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            config = json.load(f)
    template = _pick_chat_template(config.get("chat_template"))
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    # the model config's ids win; the tokenizer config fills what it leaves out
    if bos_token_id is None and (bos := _token_content(config.get("bos_token"))) is not None:
        bos_token_id = backend.token_to_id(bos)
    eos = list(eos_token_ids)
    if (eos_text := _token_content(config.get("eos_token"))) is not None:
        eos_id = backend.token_to_id(eos_text)
        if eos_id is not None and eos_id not in eos:
            eos.append(eos_id)
    return Tokenizer(backend, bos_token_id=bos_token_id, eos_token_ids=eos, chat_template=template)


# ---------------------------------------------------------------------------
# GGUF metadata


def _added_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[AddedToken]:
    added = []
    for i, (text, kind) in enumerate(zip(tokens, types)):
        if kind == TOKEN_CONTROL:
            added.append((i, AddedToken(text, special=True, normalized=False)))
        elif kind == TOKEN_USER_DEFINED:
            added.append((i, AddedToken(text, special=False, normalized=False)))
    return [tok for _, tok in sorted(added, key=lambda t: t[0])]


def _bos_post_processor(bos_token: str, bos_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single=f"{bos_token}:0 $A:0", pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
        special_tokens=[(bos_token, bos_id)],
    )


def _bpe_backend(meta: dict[str, Any]) -> BackendTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in BPE_PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))})"
        )
    regexes, ignore_merges = BPE_PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a normal piece into
    two pieces of the vocabulary, the pieces of highest score merged first."""
    vocab = {tok: i for i, (tok, kind) in enumerate(zip(tokens, types)) if kind == TOKEN_NORMAL}
    ranked = []
    for piece, idx in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[idx], vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _spm_backend(meta: dict[str, Any]) -> BackendTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = BackendTokenizer(models.BPE(
        vocab=vocab, merges=_spm_merges(tokens, scores, types), byte_fallback=True,
        unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True,
    ))
    add_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def tokenizer_from_gguf(meta: dict[str, Any], eos_token_ids: Sequence[int], bos_token_id: int | None) -> Tokenizer:
    """Rebuild the model's tokenizer from `tokenizer.ggml.*` metadata."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _bpe_backend(meta)
        default_add_bos = False
    elif kind == "llama":
        backend = _spm_backend(meta)
        default_add_bos = True
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    backend.add_tokens([t for t in _added_tokens(tokens, types) if not t.special])
    backend.add_special_tokens([t for t in _added_tokens(tokens, types) if t.special])
    if meta.get("tokenizer.ggml.add_bos_token", default_add_bos) and bos_token_id is not None:
        backend.post_processor = _bos_post_processor(tokens[bos_token_id], bos_token_id)
    return Tokenizer(
        backend, bos_token_id=bos_token_id, eos_token_ids=eos_token_ids,
        chat_template=meta.get("tokenizer.chat_template"),
    )
