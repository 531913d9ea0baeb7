"""Offline generation in the style of vLLM: LLM(model).generate(prompts, params)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from tqdm.auto import tqdm

from .config import CacheConfig, EngineConfig, SchedulerConfig
from .engine import CompletionOutput, Engine, RequestOutput
from .loader import DEFAULT_MODEL
from .outputs import TokenLogprobs
from .request import SamplingParams

PromptLike = str | list[int]


@dataclass
class _Accumulated:
    text: str = ""
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class LLM:
    """Generate for a batch of prompts on the engine's own step loop, in this thread."""

    def __init__(self, model: str = DEFAULT_MODEL, device: str = "auto", *, max_model_len: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 kv_cache_bytes: int | None = None, seed: int | None = None, quantization: str | None = None,
                 dtype: str = "auto", kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.90,
                 enforce_eager: bool = False, quantize_lm_head: bool = False) -> None:
        """vLLM's LLM arguments where the engine has them: quantization ("fp8"), dtype, kv_cache_dtype
        ("fp8"), gpu_memory_utilization (the K/V pool's share of the GPU's memory, unless
        kv_cache_bytes), enforce_eager; and quantize_lm_head (ours). The server's settings of the
        same names mean the same."""
        config = EngineConfig(
            model=model, device=device, seed=seed, quantization=quantization, dtype=dtype,
            enforce_eager=enforce_eager, quantize_lm_head=quantize_lm_head,
            cache=CacheConfig(kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, max_waiting=1 << 30),
        )
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """generate() over conversations (a list of {"role", "content"} messages, or a list of such
        lists), each rendered by the model's chat template, as vLLM's LLM.chat."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            list(c), add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})),
            add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; one final RequestOutput per prompt, in order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        results: dict[str, list[_Accumulated]] = {}
        finals: dict[str, RequestOutput] = {}
        order = []
        for prompt, params in zip(prompts, params_list):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

            def sink(out: RequestOutput) -> None:
                acc = results[out.request_id]
                for piece in out.outputs:
                    a = acc[piece.index]
                    a.text += piece.text
                    a.token_ids = (a.token_ids or []) + piece.token_ids
                    if piece.logprobs is not None:
                        a.logprobs = (a.logprobs or []) + piece.logprobs
                    a.finish_reason, a.stop_reason = piece.finish_reason, piece.stop_reason
                if out.finished:
                    finals[out.request_id] = out

            rid = f"offline-{len(order)}"
            results[rid] = [_Accumulated() for _ in range(params.n)]
            self.engine.add_request(ids, params, sink, request_id=rid)
            order.append(rid)
        with tqdm(total=len(order), desc="Generating", disable=not use_tqdm, leave=False) as bar:
            while len(finals) < len(order):
                before = len(finals)
                self.engine.step()
                bar.update(len(finals) - before)
        outputs = []
        for rid in order:
            final = finals[rid]
            if final.error is not None:
                raise RuntimeError(f"request {rid} failed: {final.error}")
            pieces = [CompletionOutput(i, a.text, a.token_ids or [], a.logprobs, a.finish_reason, a.stop_reason)
                      for i, a in enumerate(results[rid])]
            outputs.append(RequestOutput(rid, final.prompt_token_ids, pieces, finished=True,
                                         prompt_logprobs=final.prompt_logprobs,
                                         num_generated_tokens=final.num_generated_tokens, timings=final.timings))
        return outputs
