"""Our engine against HF transformers (eager, fp16) on the same GPU, in the same run.

    python bench/peer_hf.py --shape llama3-8b --batch 1,32,128 --prompt-len 512 --max-tokens 128

Both run a random-weight model of the named shape: decode throughput at each batch
(B prompts of --prompt-len tokens, --max-tokens new tokens, greedy, no early stop) and
the time of a prefill of --prefill-len tokens. Prints our / peer ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode import run_batch  # noqa: E402
from bench.prefill import ttft  # noqa: E402
from engine import Engine, EngineConfig, SchedulerConfig  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.loader.random_model import SHAPES  # noqa: E402


def hf_model(shape: dict):
    import torch
    import transformers
    kw = dict(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
              num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
              num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
              vocab_size=shape["vocab_size"], max_position_embeddings=shape["max_position_embeddings"],
              rope_theta=shape["rope_theta"], tie_word_embeddings=shape.get("tie_word_embeddings", False))
    cls, model_cls = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if shape["architecture"] == "qwen2"
                      else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    config = cls(**kw, attn_implementation="eager")
    with torch.device("cuda"):
        model = model_cls(config).to(torch.float16).eval()
    return model


def hf_decode(model, batch: int, prompt_len: int, max_tokens: int, vocab: int) -> float:
    import torch
    ids = torch.randint(100, vocab - 300, (batch, prompt_len), device="cuda")
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    return batch * max_tokens / (time.perf_counter() - t0)


def hf_prefill(model, length: int, vocab: int) -> float:
    import torch
    ids = torch.randint(100, vocab - 300, (1, length), device="cuda")
    with torch.no_grad():
        model(ids[:, :128])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    shape = SHAPES[args.shape]
    vocab = shape["vocab_size"]

    config = EngineConfig(model=f"random:{args.shape}", device="cuda", cache=CacheConfig(kv_cache_bytes=24 << 30),
                          scheduler=SchedulerConfig(max_num_seqs=max(batches), max_waiting=max(batches),
                                                    max_num_batched_tokens=max(args.prefill_len, 2048),
                                                    max_model_len=max(args.prefill_len, args.prompt_len
                                                                      + args.max_tokens) + 16))
    engine = Engine(config)
    engine.start()
    run_batch(engine, 1, 32, 8)
    ours = {b: run_batch(engine, b, args.prompt_len, args.max_tokens)["tok_s"] for b in batches}
    ours_prefill = ttft(engine, args.prefill_len, 3)
    engine.shutdown()
    del engine

    model = hf_model(shape)
    peer = {b: hf_decode(model, b, args.prompt_len, args.max_tokens, vocab) for b in batches}
    peer_prefill = hf_prefill(model, args.prefill_len, vocab)

    print(f"shape={args.shape} prompt={args.prompt_len} new={args.max_tokens} (fp16, same GPU, same run)")
    print(f"{'batch':>6} {'ours tok/s':>11} {'HF tok/s':>10} {'ratio':>7}")
    for b in batches:
        print(f"{b:>6} {ours[b]:>11.1f} {peer[b]:>10.1f} {ours[b] / peer[b]:>6.1f}x")
    print(f"prefill {args.prefill_len}: ours {ours_prefill * 1e3:.1f} ms, HF {peer_prefill * 1e3:.1f} ms, "
          f"ratio {peer_prefill / ours_prefill:.1f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "ours": ours, "hf": peer,
                                               "ours_prefill_s": ours_prefill, "hf_prefill_s": peer_prefill},
                                              indent=1))


if __name__ == "__main__":
    main()
