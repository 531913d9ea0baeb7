"""bench/kernel_trace.py: a window of engine steps' kernels (torch.profiler's Chrome trace) cut
into steps, with their spans, busy time, kernels by name and the idle time between kernels; on
a made-up trace whose numbers are known."""

from __future__ import annotations

from bench.kernel_trace import family, report, summarize


def kernel(name: str, ts: float, dur: float, cat: str = "kernel", stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_steps_spans_busy_time_and_gaps():
    events = [
        kernel("down_tail_of_an_earlier_step", 0, 5),  # before the window's first step: left out
        # a decode step: 100 us, kernels 10 + 50 + 30 = 90 us, idle 4 + 6 us
        kernel("embedding", 10, 10), kernel("nvjet_gemm_e4m3", 24, 50), kernel("flash_decode_chunk", 80, 30),
        # a step with prompts, 200 us: a memset (1 us) before a product, two attentions side by side
        kernel("embedding", 110, 20), kernel("Memset (Unknown)", 132, 1, cat="gpu_memset"),
        kernel("nvjet_gemm_e4m3", 136, 100),
        kernel("flash_prefill_wgmma", 236, 60, stream=8), kernel("flash_decode_chunk", 240, 40),
        kernel("quantize_rows_group", 300, 10),
        # the window's last step, cut off: left out
        kernel("embedding", 400, 10), kernel("nvjet_gemm_e4m3", 415, 50),
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 3},  # not a kernel
    ]
    s = summarize({"traceEvents": events})
    assert s["kernels"] == 12
    assert set(s["kinds"]) == {"decode", "with prompts"}
    dec, mixed = s["kinds"]["decode"], s["kinds"]["with prompts"]
    assert dec["steps"] == 1 and dec["span_us_p50"] == 100 and abs(dec["busy_p50"] - 0.9) < 1e-9
    assert dec["kernels_p50"] == 3 and dec["families"]["nvjet_gemm_e4m3"] == [50.0, 1.0]
    # the device idle before each step: 5 us after the earlier step's tail (0 .. 5); none before the
    # step with prompts (the decode attention ends at 110, where its embedding starts)
    assert dec["idle_before_us_p50"] == 5 and mixed["idle_before_us_p50"] == 0
    # 110 .. 310: busy 20 + 1 + 100 + (236 .. 296) + 10 = 191 of 200 (the attentions overlap)
    assert mixed["span_us_p50"] == 200 and abs(mixed["busy_p50"] - 191 / 200) < 1e-9
    assert mixed["families"]["memset"] == [1.0, 1.0] and list(mixed["families"])[0] == "nvjet_gemm_e4m3"
    # gaps by the pair, a step (over the 2 whole steps): embedding -> memset 2, memset -> product 3,
    # embedding -> product 4, product -> attention 6; then the prompt attention (ends at 296,
    # later than the decode one) -> quantize 4
    gaps = {(a, b): (us, n) for a, b, us, n in s["gaps"]}
    assert gaps == {("embedding", "memset"): (1.0, 0.5), ("memset", "nvjet_gemm_e4m3"): (1.5, 0.5),
                    ("embedding", "nvjet_gemm_e4m3"): (2.0, 0.5), ("nvjet_gemm_e4m3", "flash_decode_chunk"): (3.0, 0.5),
                    ("flash_prefill_wgmma", "quantize_rows_group"): (2.0, 0.5)}
    assert s["gaps"][0][:2] == ["nvjet_gemm_e4m3", "flash_decode_chunk"]
    # each family by the one launched before it (in start order): the decode attention after a product
    # in the decode step, after the prompt attention (launched 4 us before it) in the other
    assert dec["after"] == {"embedding < -": [10.0, 1.0], "nvjet_gemm_e4m3 < embedding": [50.0, 1.0],
                            "flash_decode_chunk < nvjet_gemm_e4m3": [30.0, 1.0]}
    assert mixed["after"]["flash_decode_chunk < flash_prefill_wgmma"] == [40.0, 1.0]
    assert mixed["after"]["nvjet_gemm_e4m3 < memset"] == [100.0, 1.0]
    text = "\n".join(report(s))
    assert "span p50 100 us, kernels busy 90.0 %" in text and "span p50 200 us, kernels busy 95.5 %" in text
    assert "the device idle 5.0 us before one (p50)" in text
    assert "flash_decode_chunk < nvjet_gemm_e4m3" not in text
    assert "flash_decode_chunk < nvjet_gemm_e4m3" in "\n".join(report(s, after=True))


def test_no_whole_step_and_names():
    s = summarize({"traceEvents": [kernel("embedding", 0, 5), {"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                                                "ts": 1, "dur": 2}]})
    assert s == {"kernels": 1, "kinds": {}, "gaps": []}
    assert "no whole step" in report(s)[-1]
    assert summarize({}) == {"kernels": 0, "kinds": {}, "gaps": []}
    assert family("void gemv<float, 8>(float const*, int)") == "void gemv"
    assert family("flash_decode_chunk") == "flash_decode_chunk"
