"""gunicorn's master resolves the worker class from our command line after it
has run the configuration module (``agentapi.gunicorn_conf``), which sets
Django up: the worker's modules import the models at their top."""

import subprocess
import sys

from tests.conftest import REPO

RESOLVE = """
import sys
from gunicorn.app.wsgiapp import WSGIApplication
sys.argv = ["gunicorn", *sys.argv[1:]]
app = WSGIApplication("%(prog)s [OPTIONS] [APP_MODULE]")
print(app.cfg.worker_class.__module__, app.cfg.worker_class.__name__)
"""


def test_the_worker_class_loads_from_the_command_line_with_its_configuration():
    from agentapi.command import gunicorn_argv

    argv = gunicorn_argv(host="127.0.0.1", port=1, certfile="c.pem", keyfile="k.pem", cafile="ca.pem")
    assert argv[1:3] == ["-m", "gunicorn"]
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE, *argv[3:]], cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["agentapi.parking", "AgentApiParkingWorker"], done.stdout
