"""What CI can check of the Docker deployment without a Docker engine."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))


def instructions(name: str) -> list[str]:
    """Arguments of every Dockerfile instruction `name` (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.upper().startswith(name + " ")]


def test_dockerfile_shape():
    froms = instructions("FROM")
    assert any(f.startswith("nvidia/cuda:") and "runtime" in f for f in froms)  # CUDA runtime base
    assert "ARG VARIANT=cuda" in DOCKERFILE and any("AS base-cpu" in f for f in froms)  # CPU-only variant
    assert froms[-1] == "base-${VARIANT}"
    users = instructions("USER")
    assert users and users[-1] not in ("root", "0")  # runs as a non-root user
    assert any("/home/cuserve/.cache/cuserve" in v for v in instructions("VOLUME"))  # model cache volume
    assert any("/health" in h for h in instructions("HEALTHCHECK"))
    assert instructions("ENTRYPOINT") == ['["cuserve", "serve", "--config", "/opt/cuserve/config.yaml"]']
    assert instructions("CMD") == ["[]"]  # flags after the image name pass through to `cuserve serve`


def test_dockerfile_installs_like_ci():
    runs = instructions("RUN")
    assert any("tools/install.sh ${CUSERVE_EXTRAS}" in r for r in runs)
    assert "CUSERVE_EXTRAS=cuda13" in DOCKERFILE  # the GPU image installs the CUDA extra
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "bash tools/install.sh test && python -m pytest -q" in readme  # CI runs the README's test command
    assert "README.md" in ci and "eval" in ci


def test_dockerfile_copies_exist_and_config_is_the_repos():
    for args in instructions("COPY"):
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), src
    assert any(a.startswith("pyproject.toml README.md config.yaml") for a in instructions("COPY"))
    assert "/opt/cuserve/config.yaml" in instructions("ENTRYPOINT")[0]  # WORKDIR /opt/cuserve + COPY config.yaml
    assert instructions("WORKDIR") == ["/opt/cuserve"]


def services():
    return COMPOSE["services"]


def test_compose_references_only_existing_files():
    for name, svc in services().items():
        build = svc.get("build")
        if build:
            context = ROOT / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), (name, source)
            else:
                assert source in COMPOSE["volumes"], (name, source)  # a named volume, declared


def test_compose_gpu_service_and_scale_profile():
    main = services()["cuserve"]
    device = main["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert main["ports"] == ["8000:8000"]
    assert "./config.yaml:/opt/cuserve/config.yaml:ro" in main["volumes"]
    assert "model-cache:/home/cuserve/.cache/cuserve" in main["volumes"]
    assert "/health" in " ".join(main["healthcheck"]["test"])
    replicas = sorted(n for n, s in services().items() if s.get("profiles") == ["scale"] and n.startswith("replica"))
    assert len(replicas) >= 2
    gpus = [services()[r]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for r in replicas]
    assert len({tuple(g) for g in gpus}) == len(replicas)  # one GPU each
    nginx = services()["nginx"]
    assert nginx["profiles"] == ["scale"] and set(nginx["depends_on"]) == set(replicas)
    conf = (ROOT / "deploy" / "nginx.conf").read_text(encoding="utf-8")
    assert "least_conn" in conf and "proxy_buffering off" in conf
    upstream = set(re.findall(r"server (replica-\d+):8000", conf))
    assert upstream == set(replicas)
