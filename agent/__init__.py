"""The llmgw node agent: standalone, imports nothing from Django or the control plane.

Its dependencies are PyYAML, httpx, cryptography (the node's own key and
certificate requests) and the standard library (nvidia-ml-py is
imported only when a node prefers NVML). The one thing it shares with the
control plane is ``agent.protocol``.
"""

__version__ = "0.1.0"
