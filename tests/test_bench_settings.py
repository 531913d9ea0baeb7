"""bench/settings.py: --set MODULE.NAME=VALUE for the engine-mode benchmarks."""

from __future__ import annotations

import functools
import importlib

import pytest

from bench import settings

SETTING = ("engine.engine", "LATE_AHEAD_ARRIVALS_S")  # a float the engine reads at run time


def read_setting(_engine, module: str, name: str):
    """Through EngineProcess.call: the setting's value in the engine's process."""
    return getattr(importlib.import_module(module), name)


def test_parse_takes_python_literals_and_refuses_the_rest():
    assert settings.parse(["a.b.C=False", " x.Y = (16, 32) ", "m.N='p=q'"]) == [
        ("a.b", "C", False), ("x", "Y", (16, 32)), ("m", "N", "p=q")]
    for bad, message in (("a.b.C", "MODULE.NAME=VALUE"), ("C=1", "MODULE.NAME=VALUE"), ("a.=1", "MODULE.NAME=VALUE"),
                         ("a.b.C=yes", "not a Python literal"), ("a.b.C=", "not a Python literal")):
        with pytest.raises(ValueError, match=message):
            settings.parse([bad])


def test_apply_sets_existing_settings_of_their_type_only(monkeypatch):
    import engine.engine as engine_module
    module, name = SETTING
    monkeypatch.setattr(engine_module, name, 1.0)  # restored after the test
    settings.apply([(module, name, 3)])  # an int for a float: a number stays a number
    assert engine_module.LATE_AHEAD_ARRIVALS_S == 3
    for setting, message in (((module, "NO_SUCH_SETTING", 1), "has no setting"),
                             (("engine.no_such_module", "X", 1), "cannot import"),
                             ((module, name, True), "is a bool, the setting a int"),
                             ((module, name, "2"), "is a str")):
        with pytest.raises(ValueError, match=message):
            settings.apply([setting])
    assert engine_module.LATE_AHEAD_ARRIVALS_S == 3  # a refused setting changes nothing


def test_serve_bench_takes_set_in_engine_mode_only(capsys):
    from bench import serve
    args = serve.parse_args(["--engine", "x", "--set", "engine.engine.LATE_AHEAD_ARRIVALS_S=2.5",
                             "--set", "a.B=(1, 2)"])
    assert args.settings == [("engine.engine", "LATE_AHEAD_ARRIVALS_S", 2.5), ("a", "B", (1, 2))]
    for argv, message in ((["--set", "a.B=1"], "needs --engine"), (["--engine", "x", "--set", "a.B"], "MODULE.NAME")):
        with pytest.raises(SystemExit):
            serve.parse_args(argv)
        assert message in capsys.readouterr().err


def test_the_engine_process_applies_the_settings_before_its_engine(smollm2_path):
    """EngineProcess(build=build_engine with the settings): the child has the new value, this
    process keeps its own."""
    from engine import EngineConfig, SchedulerConfig
    from engine.engine_process import EngineProcess
    module, name = SETTING
    here = read_setting(None, module, name)
    config = EngineConfig(model=smollm2_path, device="cpu", scheduler=SchedulerConfig(max_model_len=256))
    engine = EngineProcess(config, build=functools.partial(settings.build_engine, [(module, name, here + 7.5)]))
    try:
        engine.start()
        assert engine.call(read_setting, module, name) == here + 7.5
    finally:
        engine.shutdown()
    assert read_setting(None, module, name) == here


def test_weight_flags_give_the_engine_config_fields():
    """The weight flags that decode.py, prefill.py and serve.py --engine share with the server
    (add_weight_flags) become EngineConfig's fields, and the config checks them as the server's do."""
    import argparse

    from engine import EngineConfig
    ap = argparse.ArgumentParser()
    settings.add_weight_flags(ap)
    fields = settings.weight_settings(ap.parse_args([]))
    assert fields == {"quantization": None, "fp8_accumulation": "fast", "quantize_lm_head": False, "dtype": "auto"}
    args = ap.parse_args(["--quantization", "fp8", "--quantize-lm-head", "--dtype", "bfloat16"])
    config = EngineConfig(model="m", **settings.weight_settings(args))
    assert (config.quantization, config.quantize_lm_head, config.dtype) == ("fp8", True, "bfloat16")
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization fp8"):
        EngineConfig(model="m", **settings.weight_settings(ap.parse_args(["--quantize-lm-head"])))
