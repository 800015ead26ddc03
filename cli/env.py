"""What the ``llmgw`` command takes from its environment, in one place, and
Django's set-up for the commands that run the control plane's code in-process.

Those commands (up, demo, ctl cert) import the apps' models, which Django
allows only after ``setup_django``; ``llmgw agent`` runs on nodes where only
the agent's dependencies may be installed, and ``llmgw ctl`` over REST needs
no Django either. So Django and the apps are imported inside functions here,
in ``cli/main.py`` and in ``cli/ctl/certs.py``, and nowhere else in ``cli/``
is that needed: the modules those functions import (``up``, ``demo``) are
only ever imported once Django is set up.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_URL = "http://127.0.0.1:8000"
# The embedded default's data directory when LLMGW_DATA_DIR is unset or empty:
# ./var beside the code. llmgw_site/settings.py takes DATA_DIR from
# local_data_dir() too, so the command and the processes it starts agree.
DEFAULT_DATA_DIR = REPO / "var"


def control_plane_url() -> str:
    """Where ``llmgw ctl`` finds the operator API: ``LLMGW_URL``."""
    return os.environ.get("LLMGW_URL", DEFAULT_URL).rstrip("/")


def local_data_dir() -> Path:
    """``LLMGW_DATA_DIR``, or ``DEFAULT_DATA_DIR`` wherever the command is run
    from: ``settings.DATA_DIR`` is this, resolved."""
    return Path(os.environ.get("LLMGW_DATA_DIR") or DEFAULT_DATA_DIR)


def demo_data_dir() -> str:
    return os.environ.get("LLMGW_DATA_DIR") or "var/demo"


def api_token() -> str:
    """``LLMGW_TOKEN``, or the token file a local ``llmgw up`` wrote; empty if neither."""
    token = os.environ.get("LLMGW_TOKEN", "")
    if not token:
        token_file = local_data_dir() / "ctl-token"
        if token_file.exists():
            token = token_file.read_text().strip()
    return token


def child_env(data_dir: Path) -> dict[str, str]:
    """The environment of the processes ``llmgw up`` and ``llmgw demo`` start."""
    return dict(os.environ, LLMGW_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")


def llmgw_command() -> str:
    """How to call this command again, for the lines printed to a person."""
    return sys.argv[0] if sys.argv and sys.argv[0].endswith("llmgw") else "llmgw"


def setup_django(data_dir: str | None = None) -> None:
    # Every llmgw process that loads the control plane may write into the data
    # directory (the database, certificates, the metrics files its modules'
    # counters open at import): private from the start, as for `llmgw up`.
    from .datadir import UMASK

    os.umask(UMASK)
    if data_dir:
        os.environ["LLMGW_DATA_DIR"] = str(Path(data_dir).resolve())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
    import django
    from django.core.exceptions import ImproperlyConfigured

    try:
        django.setup()
    except ImproperlyConfigured as exc:
        # Settings that cannot work together (llmgw_site/settings.py says
        # which): refuse before starting anything, in words, not a traceback.
        raise SystemExit(f"llmgw: {exc}") from None


def ensure_migrated(verbosity: int = 0) -> None:
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=verbosity)
