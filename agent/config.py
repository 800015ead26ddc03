"""agent.yaml: read, check, and refuse with messages a person can act on.

Every error names the field and says what to do. All errors are collected, so
one run of ``llmgw agent`` lists everything wrong with a file. The file-system
checks (certificates, HCAs under ``ib_root``, a configured nvidia-smi) belong
here too: an agent that started with them wrong would run, report, and be
wrong quietly.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .durations import BadDuration, parse_duration
from .engine_user import engine_user_problem
from .identity import cert_window
from .protocol import FABRIC_NAME_RE, HCA_NAME_RE, NODE_ID_RE, mgmt_addr_problem
from .weights_files import HF_ENDPOINT, WeightsConfig, read_token

CONFIG_EXIT_STATUS = 2
USER_NAME_RE = re.compile(r"^[a-z_][a-z0-9_.-]{0,31}$")


class ConfigError(Exception):
    def __init__(self, path: str, errors: list[str]) -> None:
        self.path = path
        self.errors = errors
        super().__init__(f"{path}: " + "; ".join(errors))

    def report(self) -> str:
        lines = [f"llmgw agent: {self.path} has {len(self.errors)} problem(s); the agent did not start:"]
        lines += [f"  - {e}" for e in self.errors]
        return "\n".join(lines)


@dataclass(frozen=True)
class TlsConfig:
    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class FabricConfig:
    name: str
    hcas: tuple[str, ...]


@dataclass(frozen=True)
class DiscoveryConfig:
    nvidia_smi: str = ""  # empty: look on PATH
    ib_root: Path = Path("/sys/class/infiniband")
    prefer_nvml: bool = False
    skip_gpus: bool = False


@dataclass(frozen=True)
class SupervisorConfig:
    work_dir: Path = Path("/var/lib/llmgw-agent")
    log_lines: int = 512
    stop_timeout: float = 60.0
    health_interval: float = 2.0
    # Crash-loop backoff: an engine that fails at start is started again after
    # restart_backoff, then twice that, ..., at most restart_backoff_max. An
    # engine without a health check has failed at start when it exits within
    # start_window of starting; one with a health check, before it passed it.
    restart_backoff: float = 1.0
    restart_backoff_max: float = 60.0
    start_window: float = 60.0
    engine_user: str = ""  # empty: engines run as the agent (agent.engine_user)


TELEMETRY_SOURCES = ("auto", "nvml", "nvidia-smi", "sim", "off")


@dataclass(frozen=True)
class TelemetryConfig:
    # auto: NVML where nvidia-ml-py and the driver answer, else nvidia-smi's query.
    source: str = "auto"
    interval: float = 10.0
    sim_dir: Path | None = None  # source sim: the simulated node's fake NVML (agent.nvml_fake)


@dataclass(frozen=True)
class AgentConfig:
    node_id: str
    server: str
    tls: TlsConfig
    mgmt_addr: str
    mgmt_interface: str = "eth0"
    heartbeat_interval: float = 5.0
    reconnect_base: float = 1.0
    reconnect_max: float = 30.0
    fabrics: tuple[FabricConfig, ...] = ()
    discovery: DiscoveryConfig = DiscoveryConfig()
    supervisor: SupervisorConfig = SupervisorConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    weights: WeightsConfig | None = None  # None: no weights cache (every model's weights are placed by hand)

    def fabric_of(self, hca: str) -> str | None:
        for fabric in self.fabrics:
            if hca in fabric.hcas:
                return fabric.name
        return None


TOP_KEYS = (
    "node_id", "server", "tls", "mgmt_addr", "mgmt_interface", "heartbeat_interval",
    "reconnect_base", "reconnect_max", "fabrics", "discovery", "supervisor", "engine_user", "telemetry", "weights",
)
TELEMETRY_KEYS = ("source", "interval", "sim_dir")
WEIGHTS_KEYS = ("cache_dir", "budget", "downloads", "bandwidth", "verify_on_start", "hf_endpoint", "hf_token_file")
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(i?)B?\s*$", re.IGNORECASE)
TLS_KEYS = ("ca", "cert", "key")
FABRIC_KEYS = ("name", "hcas")
DISCOVERY_KEYS = ("nvidia_smi", "ib_root", "prefer_nvml", "skip_gpus")
SUPERVISOR_KEYS = ("work_dir", "log_lines", "stop_timeout", "health_interval", "restart_backoff",
                   "restart_backoff_max", "start_window")

_TLS_HINT = "as written by 'llmgw ctl cert issue-client NODE --out DIR' (DIR/ca.pem, DIR/NODE.pem, DIR/NODE-key.pem)"


class _Reader:
    """Reads one mapping after another, collecting every problem it finds."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.errors: list[str] = []

    def error(self, field: str, message: str) -> None:
        self.errors.append(f"{field}: {message}")

    def mapping(self, value: Any, field: str, known: tuple[str, ...]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.error(field, f"must be a mapping with keys {', '.join(known)}")
            return {}
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                where = f"{field}.{key}" if field else str(key)
                self.error(where, f"unknown key; {hint}known keys here are {', '.join(known)}")
        return value

    def string(self, data: dict, key: str, field: str, *, default: str | None = None) -> str:
        value = data.get(key)
        if value is None or value == "":
            if default is None:
                self.error(field, "missing; it is required")
                return ""
            return default
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            self.error(field, f"must be a string, not {type(value).__name__}")
            return ""
        return str(value)

    def duration(self, data: dict, key: str, field: str, default: float, *, positive: bool = True) -> float:
        if data.get(key) is None:
            return default
        try:
            seconds = parse_duration(data[key])
        except BadDuration as exc:
            self.error(field, str(exc))
            return default
        if positive and seconds <= 0:
            self.error(field, "must be longer than zero")
            return default
        return seconds

    def boolean(self, data: dict, key: str, field: str, default: bool) -> bool:
        value = data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.error(field, f"must be true or false, not {value!r}")
            return default
        return value

    def integer(self, data: dict, key: str, field: str, default: int, *, minimum: int) -> int:
        value = data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.error(field, f"must be a whole number of at least {minimum}, not {value!r}")
            return default
        return value

    def path(self, value: str) -> Path:
        # Relative paths are relative to the configuration file, not to
        # wherever the agent happened to be started from.
        path = Path(value).expanduser()
        return path if path.is_absolute() else (self.base_dir / path)


def load_config(path: str | os.PathLike) -> AgentConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the configuration: {exc.strerror or exc}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from exc
    return parse_config(data, base_dir=path.resolve().parent, source=str(path))


def parse_config(data: Any, *, base_dir: Path, source: str = "agent.yaml") -> AgentConfig:
    r = _Reader(base_dir)
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must be a YAML mapping (node_id: ..., server: ..., tls: ...)"])
    top = r.mapping(data, "", TOP_KEYS)

    node_id = r.string(top, "node_id", "node_id")
    if node_id and not NODE_ID_RE.match(node_id):
        r.error(
            "node_id",
            f"{node_id!r} is not a valid node id: use the node's hostname, 1-63 lowercase letters, digits, "
            "'-' or '.', starting and ending with a letter or digit (it is also the certificate's common name)",
        )

    server = r.string(top, "server", "server").rstrip("/")
    if server:
        parts = urlsplit(server)
        if parts.scheme != "https" or not parts.hostname:
            r.error("server", f"{server!r} must be the agent API's https URL, e.g. https://10.0.0.140:7443")

    tls = _read_tls(r, top.get("tls"))
    mgmt_addr = r.string(top, "mgmt_addr", "mgmt_addr")
    # The control plane decides on loopback and host names (its settings);
    # what is never an address is refused here, before any heartbeat.
    problem = mgmt_addr_problem(mgmt_addr, hostnames=True) if mgmt_addr else ""
    if problem:
        r.error("mgmt_addr", f"{problem}: give this node's IP address, where engines are reached")
    mgmt_interface = r.string(top, "mgmt_interface", "mgmt_interface", default="eth0")
    heartbeat_interval = r.duration(top, "heartbeat_interval", "heartbeat_interval", 5.0)
    reconnect_base = r.duration(top, "reconnect_base", "reconnect_base", 1.0)
    reconnect_max = r.duration(top, "reconnect_max", "reconnect_max", 30.0)
    if reconnect_base > reconnect_max:
        r.error("reconnect_base", f"is longer than reconnect_max ({top.get('reconnect_max')}); make it shorter")

    discovery = _read_discovery(r, top.get("discovery"))
    supervisor = _read_supervisor(r, top.get("supervisor"))
    engine_user = r.string(top, "engine_user", "engine_user", default="")
    if engine_user and not USER_NAME_RE.match(engine_user):
        r.error("engine_user", f"{engine_user!r} is not a user name")
    elif problem := engine_user_problem(engine_user, as_root=os.geteuid() == 0):
        r.error("engine_user", problem)
    supervisor = dataclasses.replace(supervisor, engine_user=engine_user)
    telemetry = _read_telemetry(r, top.get("telemetry"))
    fabrics = _read_fabrics(r, top.get("fabrics"), discovery.ib_root)
    weights = _read_weights(r, top.get("weights"))

    if r.errors:
        raise ConfigError(source, r.errors)
    return AgentConfig(
        node_id=node_id,
        server=server,
        tls=tls,
        mgmt_addr=mgmt_addr,
        mgmt_interface=mgmt_interface,
        heartbeat_interval=heartbeat_interval,
        reconnect_base=reconnect_base,
        reconnect_max=reconnect_max,
        fabrics=fabrics,
        discovery=discovery,
        supervisor=supervisor,
        telemetry=telemetry,
        weights=weights,
    )


def _read_telemetry(r: _Reader, value: Any) -> TelemetryConfig:
    data = r.mapping(value, "telemetry", TELEMETRY_KEYS)
    source = r.string(data, "source", "telemetry.source", default="auto")
    if source not in TELEMETRY_SOURCES:
        r.error("telemetry.source", f"{source!r} is not one of {', '.join(TELEMETRY_SOURCES)}")
        source = "auto"
    interval = r.duration(data, "interval", "telemetry.interval", 10.0)
    if interval < 1.0:
        r.error("telemetry.interval", "must be at least 1s (NVML's own sampling is slower than that)")
        interval = 10.0
    sim_text = r.string(data, "sim_dir", "telemetry.sim_dir", default="")
    sim_dir = r.path(sim_text) if sim_text else None
    if source == "sim" and sim_dir is None:
        r.error("telemetry.sim_dir", "source: sim needs sim_dir, the simulated node's directory (llmgw sim node-kit)")
    elif sim_dir is not None and not sim_dir.is_dir():
        r.error("telemetry.sim_dir", f"{sim_dir} is not a directory")
    return TelemetryConfig(source=source, interval=interval, sim_dir=sim_dir)


def parse_size(value: Any) -> int | None:
    """Bytes from 500G, 1.5T, 200MiB or a plain number (K, M, G, T, P: powers
    of 1000; Ki, Mi, ...: of 1024); None when it is not a size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    match = SIZE_RE.match(str(value)) if isinstance(value, str) else None
    if not match:
        return None
    power = "KMGTP".find(match.group(2).upper()) + 1 if match.group(2) else 0
    return int(float(match.group(1)) * (1024 if match.group(3) else 1000) ** power)


def _read_weights(r: _Reader, value: Any) -> WeightsConfig | None:
    if value is None:
        return None
    data = r.mapping(value, "weights", WEIGHTS_KEYS)
    if not isinstance(value, dict):
        return None
    text = r.string(data, "cache_dir", "weights.cache_dir")
    cache_dir = r.path(text) if text else Path()
    if text and cache_dir.exists() and not cache_dir.is_dir():
        r.error("weights.cache_dir", f"{cache_dir} exists and is not a directory")
    elif text and cache_dir.exists() and not os.access(cache_dir, os.W_OK):
        r.error("weights.cache_dir", f"{cache_dir} is not writable by this user")
    budget = parse_size(data.get("budget")) if data.get("budget") is not None else None
    if data.get("budget") is None:
        r.error("weights.budget", "missing; give the most the cache may hold, e.g. 500G (or 2TiB)")
    elif not budget:
        r.error("weights.budget", f"{data.get('budget')!r} is not a size above zero, e.g. 500G, 1.5T or 800GiB")
    bandwidth = parse_size(data.get("bandwidth", 0))
    if bandwidth is None:
        r.error("weights.bandwidth", f"{data.get('bandwidth')!r} is not a rate in bytes per second, e.g. 200M "
                "(0: no cap)")
    downloads = r.integer(data, "downloads", "weights.downloads", 2, minimum=1)
    if downloads > 64:
        r.error("weights.downloads", f"{downloads} files at once is more than 64; give fewer")
    verify = r.boolean(data, "verify_on_start", "weights.verify_on_start", True)
    hf_endpoint = r.string(data, "hf_endpoint", "weights.hf_endpoint", default=HF_ENDPOINT).rstrip("/")
    parts = urlsplit(hf_endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        r.error("weights.hf_endpoint", f"{hf_endpoint[:120]!r} is not an http(s) URL without credentials, "
                "e.g. https://huggingface.co or the mirror the catalog's sources name")
    token_text = r.string(data, "hf_token_file", "weights.hf_token_file", default="")
    token_file = r.path(token_text) if token_text else None
    if token_file is not None:
        # Checked here so that a missing token stops the agent at start, not
        # each download later; the token itself is read again at each use.
        try:
            read_token(token_file)
        except OSError as exc:
            detail = f"{token_file}: {exc.strerror}" if exc.strerror else str(exc)
            r.error("weights.hf_token_file", f"{detail}; put the hub token there (one line, "
                    "readable by the agent only: chmod 600)")
    return WeightsConfig(cache_dir=cache_dir, budget_bytes=budget or 0, downloads=downloads,
                         bandwidth=bandwidth or 0, verify_on_start=verify, hf_endpoint=hf_endpoint,
                         hf_token_file=token_file)


def _read_tls(r: _Reader, value: Any) -> TlsConfig:
    if value is None:
        r.error("tls", f"missing; give ca, cert and key, {_TLS_HINT}")
        return TlsConfig(Path(), Path(), Path())
    data = r.mapping(value, "tls", TLS_KEYS)
    paths = {}
    for key in TLS_KEYS:
        text = r.string(data, key, f"tls.{key}")
        paths[key] = r.path(text) if text else Path()
        if text and not paths[key].is_file():
            r.error(f"tls.{key}", f"{paths[key]} does not exist or is not a file; put the file there, {_TLS_HINT}")
        elif text and not os.access(paths[key], os.R_OK):
            r.error(f"tls.{key}", f"{paths[key]} is not readable by this user; the agent runs as root under systemd")
    tls = TlsConfig(**paths)
    if not any(e.startswith("tls") for e in r.errors):
        _check_tls_loads(r, tls)
    return tls


def _check_tls_loads(r: _Reader, tls: TlsConfig) -> None:
    try:
        ssl.create_default_context(cafile=str(tls.ca))
    except (ssl.SSLError, OSError) as exc:
        r.error("tls.ca", f"{tls.ca} is not a PEM certificate authority: {exc}")
    try:
        ssl.create_default_context().load_cert_chain(str(tls.cert), str(tls.key))
    except (ssl.SSLError, OSError) as exc:
        r.error("tls.key", f"{tls.cert} and {tls.key} do not load as a certificate and its key ({exc}); "
                "they must be the pair issued together for this node")
        return
    expired = certificate_expired(tls.cert)
    if expired:
        r.error("tls.cert", expired)


def certificate_expired(cert: Path, now: float | None = None) -> str:
    """Why the certificate can no longer be used ('' while it can)."""
    try:
        _start, end = cert_window(cert)
    except (OSError, ValueError):
        return ""
    if (time.time() if now is None else now) < end:
        return ""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(end))
    return (f"{cert} expired at {when}: the control plane refuses it and nothing here can renew it. "
            "Re-onboard this node: llmgw ctl onboard NODE --addr ADDRESS --reinstall")


def _read_discovery(r: _Reader, value: Any) -> DiscoveryConfig:
    data = r.mapping(value, "discovery", DISCOVERY_KEYS)
    nvidia_smi = r.string(data, "nvidia_smi", "discovery.nvidia_smi", default="")
    ib_root = r.path(r.string(data, "ib_root", "discovery.ib_root", default="/sys/class/infiniband"))
    prefer_nvml = r.boolean(data, "prefer_nvml", "discovery.prefer_nvml", False)
    skip_gpus = r.boolean(data, "skip_gpus", "discovery.skip_gpus", False)
    if nvidia_smi and not skip_gpus:
        # A path someone wrote down and got wrong is a configuration error;
        # an nvidia-smi missing from PATH or failing is reported in the
        # heartbeat instead (see agent.discovery).
        if "/" in nvidia_smi:
            nvidia_smi = str(r.path(nvidia_smi))
            found = nvidia_smi if os.path.isfile(nvidia_smi) and os.access(nvidia_smi, os.X_OK) else None
        else:
            found = shutil.which(nvidia_smi)
        if not found:
            r.error(
                "discovery.nvidia_smi",
                f"{nvidia_smi} is not an executable file; give the path where the driver installed "
                "nvidia-smi, leave it empty to look on PATH, or set skip_gpus: true on a node without GPUs",
            )
    return DiscoveryConfig(nvidia_smi=nvidia_smi, ib_root=ib_root, prefer_nvml=prefer_nvml, skip_gpus=skip_gpus)


def _read_supervisor(r: _Reader, value: Any) -> SupervisorConfig:
    data = r.mapping(value, "supervisor", SUPERVISOR_KEYS)
    default = SupervisorConfig()
    work_dir = r.path(r.string(data, "work_dir", "supervisor.work_dir", default=str(default.work_dir)))
    if work_dir.exists() and not work_dir.is_dir():
        r.error("supervisor.work_dir", f"{work_dir} exists and is not a directory")
    return SupervisorConfig(
        work_dir=work_dir,
        log_lines=r.integer(data, "log_lines", "supervisor.log_lines", default.log_lines, minimum=1),
        stop_timeout=r.duration(data, "stop_timeout", "supervisor.stop_timeout", default.stop_timeout),
        health_interval=r.duration(data, "health_interval", "supervisor.health_interval", default.health_interval),
        restart_backoff=r.duration(data, "restart_backoff", "supervisor.restart_backoff", default.restart_backoff),
        restart_backoff_max=r.duration(data, "restart_backoff_max", "supervisor.restart_backoff_max",
                                       default.restart_backoff_max),
        start_window=r.duration(data, "start_window", "supervisor.start_window", default.start_window),
    )


def _read_fabrics(r: _Reader, value: Any, ib_root: Path) -> tuple[FabricConfig, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        r.error("fabrics", "must be a list of {name, hcas}; use [] for a node with no fabric")
        return ()
    fabrics: list[FabricConfig] = []
    owner: dict[str, str] = {}
    for i, item in enumerate(value):
        field = f"fabrics[{i}]"
        data = r.mapping(item, field, FABRIC_KEYS)
        name = r.string(data, "name", f"{field}.name")
        if name and not FABRIC_NAME_RE.match(name):
            r.error(f"{field}.name", f"{name!r} is not a fabric name: letters, digits, '_', '.', '-', up to 64")
        if name and any(f.name == name for f in fabrics):
            r.error(f"{field}.name", f"fabric {name} is listed twice; list each fabric once with all its HCAs")
        hcas = data.get("hcas")
        if not isinstance(hcas, list) or not hcas or not all(isinstance(h, str) for h in hcas):
            r.error(f"{field}.hcas", "must be a non-empty list of HCA names, e.g. [mlx5_0, mlx5_1]")
            hcas = []
        for hca in hcas:
            if not HCA_NAME_RE.match(hca):
                r.error(f"{field}.hcas", f"{hca!r} is not an HCA name like mlx5_0")
            elif hca in owner and owner[hca] != name:
                r.error(
                    f"{field}.hcas",
                    f"HCA {hca} is listed under two fabrics, {owner[hca]} and {name}. An adapter is cabled to "
                    "one fabric; a node configured this way would be given replicas that start, pass their "
                    "health checks and hang on their first all-reduce. List it under the one fabric it is on",
                )
            owner.setdefault(hca, name)
        fabrics.append(FabricConfig(name=name, hcas=tuple(hcas)))
    _check_hcas_present(r, owner, ib_root)
    return tuple(fabrics)


def _check_hcas_present(r: _Reader, owner: dict[str, str], ib_root: Path) -> None:
    if not owner:
        return
    if not ib_root.is_dir():
        r.error(
            "discovery.ib_root",
            f"{ib_root} does not exist, but fabrics name HCAs ({', '.join(sorted(owner))}); is the InfiniBand "
            "driver loaded? For a node with no fabric use 'fabrics: []'",
        )
        return
    present = sorted(p.name for p in ib_root.iterdir())
    for hca, fabric in owner.items():
        if hca not in present:
            r.error(
                "fabrics",
                f"HCA {hca} (fabric {fabric}) is not on this machine: {ib_root} has "
                f"{', '.join(present) or 'no HCAs'}. Fix the name in 'fabrics', or discovery.ib_root",
            )
