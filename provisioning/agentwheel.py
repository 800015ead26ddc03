"""The agent's wheels, for nodes without internet: the ``llmgw-agent``
distribution (packaging/agent/pyproject.toml and the repository's agent/
package) and every wheel it depends on, built once per version of the agent's
sources into a cache directory and reused by every onboarding job.

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

REPO = Path(__file__).resolve().parent.parent
AGENT_SRC = REPO / "agent"
PYPROJECT = REPO / "packaging" / "agent" / "pyproject.toml"
READY = "READY"


class WheelBuildError(Exception):
    pass


def _sources() -> list[Path]:
    files = [p for p in AGENT_SRC.rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files) + [PYPROJECT]


def source_digest() -> str:
    """Changes whenever the agent's code or its packaging does."""
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
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
        shutil.copytree(AGENT_SRC, stage / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--quiet",
             "--wheel-dir", str(out), str(stage)],
            capture_output=True, text=True, timeout=900,
        )
        if proc.returncode != 0:
            raise WheelBuildError(f"building the agent's wheels failed: {proc.stderr.strip()[-2000:]}")
        (out / READY).write_text(source_digest() + "\n")
        if target.exists():
            shutil.rmtree(target)
        shutil.move(str(out), str(target))
    os.chmod(target, 0o755)


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
