"""Engines the agent can run itself. Real engines (vLLM, SGLang) are started
from the argv the control plane sends; only the simulated one lives here."""
