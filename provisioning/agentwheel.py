"""The agent's wheels, for nodes without internet: the ``llmgw-agent``
distribution (agent/dist/pyproject.toml and the agent/ package), every wheel it
depends on, and a pip wheel that installs them on the node (so the node's venv
needs no pip of its own), built once per version of the agent's sources into a
cache directory and reused by every onboarding job. The sources are found
through the installed ``agent`` package: a checkout and an installed llmgw
build the same wheels.

``python -m provisioning.agentwheel DIR`` (what ``make agent-wheel`` runs)
builds into DIR; nothing here imports Django.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import agent

AGENT_SRC = Path(agent.__file__).resolve().parent
DIST = AGENT_SRC / "dist"
PYPROJECT = DIST / "pyproject.toml"
UNIT_FILE = DIST / "llmgw-agent.service"
READY = "READY"
# What a build directory holds; a change here makes every cache stale.
LAYOUT = b"agent, its dependencies, pip"


class WheelBuildError(Exception):
    pass


def _sources() -> list[Path]:
    files = [p for p in AGENT_SRC.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files) + [PYPROJECT, UNIT_FILE]


def source_digest() -> str:
    """Changes whenever the agent's code or its packaging does."""
    digest = hashlib.sha256(LAYOUT + b"\0")
    for path in _sources():
        digest.update(str(path.relative_to(AGENT_SRC)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def wheels_ensure(cache_root: Path) -> Path:
    """The directory holding the current agent's wheels, built if missing.
    Concurrent callers (twenty jobs at once) wait for one build."""
    cache_root.mkdir(parents=True, exist_ok=True)
    target = cache_root / source_digest()
    if (target / READY).exists():
        return target
    with open(cache_root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / READY).exists():
            return target
        _build(target)
    return target


def _build(target: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-agent-build-") as tmp:
        stage, out = Path(tmp) / "src", Path(tmp) / "wheels"
        stage.mkdir()
        shutil.copy2(PYPROJECT, stage / "pyproject.toml")
        shutil.copytree(AGENT_SRC, stage / "agent",
                        ignore=lambda d, names: [n for n in names if n in ("__pycache__", "dist") or n.endswith(".pyc")])
        # pip itself, at the version installing here: it runs on the node from
        # its wheel, into a venv made --without-pip (seconds faster per node).
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--quiet",
             "--wheel-dir", str(out), str(stage), f"pip=={_pip_version()}"],
            capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            raise WheelBuildError(f"building the agent's wheels failed: {proc.stderr.strip()[-2000:]}")
        (out / READY).write_text(source_digest() + "\n")
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(out), str(target))
    os.chmod(target, 0o755)


def _pip_version() -> str:
    from importlib.metadata import version

    return version("pip").split("+")[0]


def pip_wheel(directory: Path) -> Path:
    found = sorted(directory.glob("pip-*.whl"))
    if not found:
        raise WheelBuildError(f"no pip wheel in {directory}")
    return found[-1]


def install_wheels(directory: Path) -> list[Path]:
    """What goes into the node's venv: every wheel but pip."""
    return sorted(w for w in directory.glob("*.whl") if not w.name.startswith("pip-"))


def agent_wheel(directory: Path) -> Path:
    """The llmgw-agent wheel itself in a wheel directory."""
    found = sorted(directory.glob("llmgw_agent-*.whl"))
    if not found:
        raise WheelBuildError(f"no llmgw_agent wheel in {directory}")
    return found[-1]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m provisioning.agentwheel CACHE_DIR", file=sys.stderr)
        return 2
    try:
        directory = wheels_ensure(Path(argv[0]).resolve())
    except WheelBuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    for wheel in sorted(directory.glob("*.whl")):
        print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
