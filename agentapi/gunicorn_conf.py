"""gunicorn's configuration module for the agent API (``-c python:agentapi.gunicorn_conf``).

It sets Django up in gunicorn's master process, before gunicorn imports the
worker class: ``agentapi.parking`` and ``agentapi.worker`` import
``nodes.liveness``, which imports the models. Settings stay on the command
line (``agentapi.command.gunicorn_argv``).
"""

import os

import django

os.environ["LLMGW_ROLE"] = "agent-api"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
django.setup()
