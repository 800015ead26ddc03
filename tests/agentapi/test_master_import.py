"""gunicorn's master imports the worker class before any worker sets Django
up: nothing it imports may need the app registry (a model at module level)."""

import subprocess
import sys

from tests.conftest import REPO


def test_the_worker_class_loads_before_django_is_set_up():
    done = subprocess.run(
        [sys.executable, "-c", "from gunicorn.util import load_class; "
         "load_class('agentapi.watch.AgentApiWatchWorker'); print('loaded')"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
