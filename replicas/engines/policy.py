"""What a catalog entry may put in an engine's environment and argv.

Whoever writes the catalog chooses what runs on every node. Engines run as
an unprivileged user of their own (the agent's ``engine_user``), and on top
of that the catalog may not load code into them: no variable that makes the
interpreter, the dynamic loader or a library import or execute something
(``LD_PRELOAD``, ``PYTHONPATH``, ``PYTHONWARNINGS=all::module.x``,
``BROWSER``, ``NCCL_NET_PLUGIN``...), and no engine flag that names a class,
a plugin file or a processor to import (vLLM's ``--worker-cls``, SGLang's
``--custom-weight-loader``...). Those are refused for everyone.

One thing has a real use and is allowed to admins only: ``--trust-remote-code``,
for models whose weights ship their own Python (it runs that code, as the
engine user, on every node of the replica).

Environment is an allow-list: the variable families engines and their
libraries legitimately read (NCCL, CUDA, vLLM, SGLang, Hugging Face, thread
counts, proxies), minus the names in those families that load code. Pure
functions; no Django.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ALLOWED_ENV_PREFIXES = (
    "NCCL_", "CUDA_", "CUBLAS_", "CUDNN_", "NVIDIA_", "VLLM_", "SGLANG_", "SGL_", "HF_", "HUGGING_FACE_",
    "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "OPENBLAS_", "UCX_", "NVSHMEM_", "TORCH_NCCL_",
    "PYTORCH_CUDA_", "PYTORCH_NVML_", "GLOO_",
)
ALLOWED_ENV_NAMES = frozenset({
    "TZ", "LANG", "LC_ALL", "MAX_JOBS", "TORCH_DISTRIBUTED_DEBUG", "TORCH_CUDA_ARCH_LIST",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    # A sim engine's cold start in seconds (agent/engine_process.py reads it; a number, loads nothing).
    "LLMGW_SIM_COLD_START",
})
# Within the allowed families: names that load a library or a module, or
# make an engine unpickle what a request sends.
CODE_ENV_RE = re.compile(r"PLUGIN|PRELOAD|LIBRARY|_LIB_|MODULE|EXTENSION|LOGGING_CONFIG|INSECURE|PICKLE|TRUST_REMOTE")
CODE_ENV_NAMES = {
    "VLLM_PLUGINS": "it loads vLLM plugins into every engine process",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "it lets requests send pickled objects the engine loads",
}
# Variables the probe used, and their kind, with the reason given back.
KNOWN_CODE_ENV = {
    "BROWSER": "Python's webbrowser runs it as a command",
    "PYTHONWARNINGS": "a warning filter imports the module it names",
    "PYTHONPATH": "it decides which code Python imports",
    "PYTHONSTARTUP": "Python runs that file",
    "PYTHONHOME": "it decides which Python runs",
    "PERL5LIB": "it decides which code Perl loads",
    "PERL5OPT": "it passes options to every Perl",
    "BASH_ENV": "bash runs that file at start",
    "ENV": "sh runs that file at start",
    "NODE_OPTIONS": "it passes options (--require) to every Node.js",
    "PATH": "it decides which programs run",
    "IFS": "it changes how shells split words",
    "HOME": "the engine user's home is set by the agent",
    "USER": "the engine user is set by the agent",
}


@dataclass(frozen=True)
class Refusal:
    name: str  # the variable or the flag
    reason: str
    admin_may: bool = False  # allowed when an admin writes the entry


def env_refusal(name: str) -> Refusal | None:
    """Why a catalog entry may not set this variable (None: it may)."""
    if name in KNOWN_CODE_ENV:
        return Refusal(name, KNOWN_CODE_ENV[name])
    if name.startswith(("LD_", "PYTHON", "DYLD_")):
        return Refusal(name, "it changes what the loader or the interpreter runs")
    if name in CODE_ENV_NAMES:
        return Refusal(name, CODE_ENV_NAMES[name])
    allowed = name in ALLOWED_ENV_NAMES or name.startswith(ALLOWED_ENV_PREFIXES)
    if not allowed:
        return Refusal(name, "it is not among the variables engines are given (NCCL_*, CUDA_*, VLLM_*, SGLANG_*, "
                             "HF_*, TRANSFORMERS_*, OMP_*, proxies...; docs/catalog.md lists them)")
    if CODE_ENV_RE.search(name.upper()):
        return Refusal(name, "it makes the engine load a library or a module")
    return None


_IMPORTS = "it names code for the engine to import and run"
# Per engine: flags that load code. Refused outright unless in ADMIN_FLAGS.
CODE_FLAGS: dict[str, dict[str, str]] = {
    "vllm": {
        "--worker-cls": _IMPORTS,
        "--worker-extension-cls": _IMPORTS,
        "--scheduler-cls": _IMPORTS,
        "--model-class-overrides": _IMPORTS,
        "--logits-processors": _IMPORTS,
        "--tool-parser-plugin": "it loads a Python file as a plugin",
        "--reasoning-parser-plugin": "it loads a Python file as a plugin",
        "--io-processor-plugin": "it loads a plugin",
        "--logging-config": "a logging configuration can instantiate any class",
        "--log-config-file": "a logging configuration can instantiate any class",
        "--allowed-local-media-path": "it lets every API key holder read files on the node",
        "--trust-remote-code": "it runs the Python that ships with the weights",
    },
    "sglang": {
        "--custom-weight-loader": _IMPORTS,
        "--enable-custom-logit-processor": "it lets requests send serialized code that the engine runs",
        "--trust-remote-code": "it runs the Python that ships with the weights",
    },
}
ADMIN_FLAGS = frozenset({"--trust-remote-code"})


def flag_refusal(engine: str, flag: str) -> Refusal | None:
    """Why a catalog entry may not pass this flag to this engine (None: it may)."""
    reason = CODE_FLAGS.get(engine, {}).get(flag)
    if reason is None:
        return None
    return Refusal(flag, reason, admin_may=flag in ADMIN_FLAGS)


def refusal_message(refusal: Refusal) -> str:
    if refusal.admin_may:
        return f"{refusal.name}: only an admin may set it ({refusal.reason}); ask an admin to apply this entry"
    return f"{refusal.name} is refused: {refusal.reason}. Remove it (docs/catalog.md, 'What an entry may not set')"
