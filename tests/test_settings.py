"""Settings precedence, validation, and the docs generated from them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server.cli import build_parser
from server.settings import SETTINGS, ServeSettings, resolve_settings

ROOT = Path(__file__).resolve().parent.parent


def parse(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_without_anything(monkeypatch):
    for name in SETTINGS:
        monkeypatch.delenv(f"CUSERVE_{name.upper()}", raising=False)
    assert resolve_settings(parse()) == ServeSettings()


def test_precedence_yaml_env_cli(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("port: 9001\nmax_num_seqs: 7\nenforce_eager: true\nhost: 0.0.0.0\n")
    monkeypatch.setenv("CUSERVE_PORT", "9002")
    monkeypatch.setenv("CUSERVE_MAX_NUM_SEQS", "9")
    s = resolve_settings(parse("--config", str(cfg), "--max-num-seqs", "11"))
    assert (s.port, s.max_num_seqs, s.enforce_eager, s.host) == (9002, 11, True, "0.0.0.0")
    s = resolve_settings(parse("--config", str(cfg), "--no-enforce-eager"))
    assert s.enforce_eager is False


def test_bad_values_are_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("CUSERVE_PORT", "eighty")
    with pytest.raises(ValueError, match="CUSERVE_PORT: port must be int"):
        resolve_settings(parse())
    monkeypatch.delenv("CUSERVE_PORT")
    bad = tmp_path / "bad.yaml"
    bad.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="unknown settings prot"):
        resolve_settings(parse("--config", str(bad)))
    with pytest.raises(ValueError, match="device must be one of"):
        ServeSettings(device="tpu")
    with pytest.raises(SystemExit):
        parse("--device", "tpu")


def test_engine_config_follows_settings():
    cfg = ServeSettings(max_model_len=512, kv_cache_gib=0.5, max_waiting=3, served_model_name="m").engine_config()
    assert cfg.scheduler.max_model_len == 512 and cfg.scheduler.max_waiting == 3
    assert cfg.cache.kv_cache_bytes == 1 << 29 and cfg.served_model_name == "m"
    assert cfg.scheduler.prompts_ahead
    assert not ServeSettings(schedule_prompts_ahead=False).engine_config().scheduler.prompts_ahead


def test_api_server_count_setting(monkeypatch):
    """By default two HTTP processes where the model runs on a GPU (decided once the engine is up),
    one on the CPU or with the engine on a thread; a count given is kept, and more than one needs
    the engine process."""
    auto = ServeSettings()
    assert auto.api_server_count is None and auto.api_servers_at_most() == 2
    assert (auto.api_servers("cuda"), auto.api_servers("cpu")) == (2, 1)
    assert ServeSettings(device="cpu").api_servers_at_most() == 1
    assert ServeSettings(engine_process=False).api_servers("cuda") == 1
    three = ServeSettings(api_server_count=3)
    assert (three.api_servers_at_most(), three.api_servers("cpu"), three.api_servers("cuda")) == (3, 3, 3)
    assert ServeSettings(api_server_count=1).api_servers("cuda") == 1
    with pytest.raises(ValueError, match="api_server_count must be >= 1"):
        ServeSettings(api_server_count=0)
    with pytest.raises(ValueError, match="needs engine_process"):
        ServeSettings(api_server_count=2, engine_process=False)
    monkeypatch.setenv("CUSERVE_API_SERVER_COUNT", "4")
    assert resolve_settings(parse()).api_server_count == 4
    assert resolve_settings(parse("--api-server-count", "2")).api_server_count == 2


def test_kv_cache_dtype_setting(tmp_path):
    cfg = ServeSettings(kv_cache_dtype="fp8").engine_config()
    assert cfg.cache.kv_cache_dtype == "fp8" and cfg.cache.kv_fp8
    assert not ServeSettings().engine_config().cache.kv_fp8
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ServeSettings(kv_cache_dtype="int4")
    from engine.config import CacheConfig, EngineConfig
    from engine.loader import load_model
    from engine.runner import make_runner
    from tests.tiny_models import build_tiny_model
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=1)), with_tokenizer=False)
    with pytest.raises(ValueError, match="needs the CUDA runner"):
        make_runner(EngineConfig(model="tiny", device="cpu", cache=CacheConfig(kv_cache_dtype="fp8")), model)


def test_quantization_setting(tmp_path, monkeypatch):
    assert ServeSettings(quantization="fp8").engine_config().quantization == "fp8"
    assert ServeSettings().engine_config().quantization is None
    monkeypatch.setenv("CUSERVE_QUANTIZATION", "fp8")
    assert resolve_settings(parse()).quantization == "fp8"
    assert resolve_settings(parse("--quantization", "fp8")).quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        ServeSettings(quantization="int4")
    assert ServeSettings().engine_config().fp8_accumulation == "fast"  # as vLLM's fp8 kernels add
    assert resolve_settings(parse("--fp8-accumulation", "promoted")).engine_config().fp8_accumulation == "promoted"
    with pytest.raises(ValueError, match="fp8_accumulation must be one of fast, promoted"):
        ServeSettings(fp8_accumulation="exact")
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="fp8_accumulation must be one of fast, promoted"):
        EngineConfig(model="m", fp8_accumulation="float32")
    from engine.loader import load_model
    from engine.runner import make_runner
    from tests.tiny_models import build_tiny_model
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=1)), with_tokenizer=False)
    with pytest.raises(ValueError, match="--quantization fp8 needs the CUDA runner"):
        make_runner(EngineConfig(model="tiny", device="cpu", quantization="fp8"), model)


def test_quantize_lm_head_setting(monkeypatch):
    """--quantize-lm-head (off by default, as vLLM keeps the LM head 16-bit) needs --quantization fp8."""
    assert ServeSettings(quantization="fp8").engine_config().quantize_lm_head is False
    got = resolve_settings(parse("--quantization", "fp8", "--quantize-lm-head")).engine_config()
    assert got.quantize_lm_head is True and got.quantization == "fp8"
    monkeypatch.setenv("CUSERVE_QUANTIZE_LM_HEAD", "true")
    assert resolve_settings(parse("--quantization", "fp8")).quantize_lm_head is True
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization fp8"):
        resolve_settings(parse())
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization fp8"):
        EngineConfig(model="m", quantize_lm_head=True)


def test_dtype_setting(tmp_path, monkeypatch):
    """--dtype: the 16-bit type the runners compute in; auto follows the checkpoint."""
    from engine.config import EngineConfig
    assert ServeSettings().engine_config().dtype == "auto"
    assert resolve_settings(parse("--dtype", "bfloat16")).engine_config().dtype == "bfloat16"
    monkeypatch.setenv("CUSERVE_DTYPE", "float16")
    assert resolve_settings(parse()).engine_config().dtype == "float16"
    with pytest.raises(ValueError, match="dtype must be one of auto, float16, bfloat16"):
        ServeSettings(dtype="float32")
    with pytest.raises(ValueError, match="dtype must be one of auto, float16, bfloat16"):
        EngineConfig(model="m", dtype="half")
    auto, bf16 = EngineConfig(model="m"), EngineConfig(model="m", dtype="bfloat16")
    assert [auto.compute_dtype(d) for d in ("bfloat16", "float16", "float32")] == ["bfloat16", "float16", "float16"]
    assert [bf16.compute_dtype(d) for d in ("bfloat16", "float16", "float32")] == ["bfloat16"] * 3
    assert EngineConfig(model="m", dtype="float16").compute_dtype("bfloat16") == "float16"
    # the CPU runner's 16-bit weights follow it (cpu_weight_dtype auto, with its C kernels)
    from engine.loader import load_model
    from engine.runner import make_runner
    from tests.tiny_models import build_tiny_model
    model = load_model(str(build_tiny_model(tmp_path, "llama", seed=1)), with_tokenizer=False)
    for dtype in ("auto", "bfloat16"):
        runner = make_runner(EngineConfig(model="tiny", device="cpu", dtype=dtype), model)
        expect = ("float16" if dtype == "auto" else "bfloat16") if runner.kernels is not None else "float32"
        assert runner.weight_dtype == expect


def test_config_yaml_and_readme_table_are_current():
    result = subprocess.run([sys.executable, "tools/gen_docs.py", "--check"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout
    import yaml
    documented = yaml.safe_load((ROOT / "config.yaml").read_text())
    assert documented == {name: f.default for name, f in SETTINGS.items()}


def test_cli_help_and_bad_config_exit_codes(tmp_path):
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0 and "--max-model-len" in out.stdout and "--api-key" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [1, 2]\n")
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--config", str(bad)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2 and "port must be int" in out.stderr
