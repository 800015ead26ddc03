"""The one settings module of llmgw, configured from the environment.

With no configuration at all it runs on an embedded default under one data
directory: SQLite in WAL mode, a Celery broker kept in files, liveness kept in
the database. Point ``DATABASE_URL`` at PostgreSQL and ``CELERY_BROKER_URL`` at
Redis for production; liveness then moves to Redis (``LLMGW_REDIS_URL``,
which defaults to a ``redis://`` broker URL).
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

import environ

from cli.env import local_data_dir

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()

# LLMGW_DATA_DIR, or ./var beside the code: the llmgw command's own rule
# (cli/env.py, which imports nothing but the standard library), so that
# `llmgw ctl` finds the token `llmgw up` wrote.
DATA_DIR = local_data_dir().resolve()
PKI_DIR = Path(env.str("LLMGW_PKI_DIR", default=str(DATA_DIR / "pki"))).resolve()

# Which process this is, set by each server's entry point: "agent-api" (its
# own URLconf and no middleware: it serves one kind of caller, authenticated
# by TLS, at a rate of thousands of requests per second), "web" (ASGI);
# anything else (a Celery worker, beat, manage.py) is "other".
ROLE = env.str("LLMGW_ROLE", default="other")


def _secret_key() -> str:
    if env.str("DJANGO_SECRET_KEY_FILE", default=""):
        return Path(env.str("DJANGO_SECRET_KEY_FILE")).read_text().strip()
    if env.str("DJANGO_SECRET_KEY", default=""):
        return env.str("DJANGO_SECRET_KEY")
    key_file = DATA_DIR / "secret-key"
    if key_file.exists():
        return key_file.read_text().strip()
    # Embedded default: make one and keep it, so sessions survive restarts.
    # Created 0600, never readable by others even for a moment.
    from django.utils.crypto import get_random_string

    DATA_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = get_random_string(64)
    try:
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return key_file.read_text().strip()
    with os.fdopen(fd, "w") as handle:
        handle.write(key)
    return key


SECRET_KEY = _secret_key()
DEBUG = env.bool("DJANGO_DEBUG", default=False)

# Where operators reach the web process (``https://llmgw.example.org``), as a
# TLS reverse proxy in front of it serves it. Over https, cookies are sent only
# over TLS and browsers are told to use nothing else (HSTS).
LLMGW_PUBLIC_URL = env.str("LLMGW_PUBLIC_URL", default="").rstrip("/")
_public = urlsplit(LLMGW_PUBLIC_URL)
if LLMGW_PUBLIC_URL and (_public.scheme not in ("http", "https") or not _public.hostname):
    raise ValueError(f"LLMGW_PUBLIC_URL={LLMGW_PUBLIC_URL!r}: give the full address, e.g. https://llmgw.example.org")
if _public.scheme == "https":
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env.int("LLMGW_HSTS_SECONDS", default=31536000)
    CSRF_TRUSTED_ORIGINS = [f"{_public.scheme}://{_public.netloc}"]
    # The proxy terminates TLS and says so; only it can reach the web process.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# The address the web process listens on ('llmgw up --host' sets it for its
# processes). With DJANGO_ALLOWED_HOSTS unset, the web process answers only
# to Host headers naming loopback, this address and LLMGW_PUBLIC_URL's host:
# a page from elsewhere whose name is made to resolve to 127.0.0.1 (DNS
# rebinding) reaches nothing. Listening on every interface (0.0.0.0, ::)
# with nothing set keeps '*' ('llmgw up' warns).
LLMGW_WEB_HOST = env.str("LLMGW_WEB_HOST", default="127.0.0.1")


def _allowed_hosts() -> list[str]:
    if env.str("DJANGO_ALLOWED_HOSTS", default=""):
        return env.list("DJANGO_ALLOWED_HOSTS")
    if LLMGW_WEB_HOST in ("", "0.0.0.0", "::"):
        return ["*"]
    hosts = ["localhost", "127.0.0.1", "[::1]"]
    bound = f"[{LLMGW_WEB_HOST}]" if ":" in LLMGW_WEB_HOST else LLMGW_WEB_HOST
    for host in (bound, _public.hostname if LLMGW_PUBLIC_URL else ""):
        if host and host not in hosts:
            hosts.append(host)
    return hosts


ALLOWED_HOSTS = _allowed_hosts()

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "core",
    "pki",
    "nodes",
    "replicas",
    "gateway",
    "provisioning",
    "django_htmx",
    "ui",
    # Last: its post_migrate hook gives the role groups every app's permissions.
    "accounts",
]

if ROLE == "agent-api":
    ROOT_URLCONF = "agentapi.urls"
    MIDDLEWARE: list[str] = []
else:
    ROOT_URLCONF = "llmgw_site.urls"
    MIDDLEWARE = [
        "django.middleware.security.SecurityMiddleware",
        "web.middleware.RejectNulMiddleware",
        "web.middleware.DependencyUnavailableMiddleware",
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.common.CommonMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
        "django.middleware.clickjacking.XFrameOptionsMiddleware",
        "django_htmx.middleware.HtmxMiddleware",
    ]

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "llmgw_site.wsgi.application"
ASGI_APPLICATION = "llmgw_site.asgi.application"

_default_db = f"sqlite:///{DATA_DIR / 'llmgw.sqlite3'}"
DATABASES = {"default": env.db_url("DATABASE_URL", default=_default_db)}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            # WAL lets the web, agent API, worker and beat processes read while
            # one of them writes; IMMEDIATE avoids lock upgrades that fail.
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            "transaction_mode": "IMMEDIATE",
            "timeout": 30,
        }
    )
else:
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
    # pg_stat_activity names the process each connection belongs to.
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("application_name", f"llmgw pid {os.getpid()}")
    # Connections each process may hold (docs/production.md counts them). The
    # agent API answers from many threads, few of which need the database at
    # once, and the web process (ASGI) runs each request in a new thread: a
    # connection kept per thread there was never used again and piled up
    # (51 after 1,200 requests). Both share a small pool (psycopg_pool)
    # instead. 0: no pool, each thread keeps its own connection for
    # LLMGW_DB_CONN_MAX_AGE seconds (the worker's threads or children, beat).
    LLMGW_DB_POOL_MAX = env.int("LLMGW_DB_POOL_MAX", default=4 if ROLE in ("agent-api", "web") else 0)
    if LLMGW_DB_POOL_MAX > 0:
        DATABASES["default"]["CONN_MAX_AGE"] = 0  # Django returns the connection to the pool after each request
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": LLMGW_DB_POOL_MAX,
            # How long a request waits for a connection before answering 503.
            "timeout": env.float("LLMGW_DB_POOL_TIMEOUT", default=5.0),
        }
    else:
        DATABASES["default"]["CONN_MAX_AGE"] = env.int("LLMGW_DB_CONN_MAX_AGE", default=600)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Django's four validators are the floor: every path that sets a password
# ('ctl users add', the API, the Django admin, createsuperuser) applies them.
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# Password logins pass a throttle (accounts/throttle.py): after this many
# failures within LLMGW_LOGIN_WINDOW seconds, logins for that user name, or
# from that address, are refused until the window ends.
AUTHENTICATION_BACKENDS = ["accounts.backends.ThrottledModelBackend"]
LLMGW_LOGIN_FAILURES_PER_USER = env.int("LLMGW_LOGIN_FAILURES_PER_USER", default=10)
LLMGW_LOGIN_FAILURES_PER_ADDRESS = env.int("LLMGW_LOGIN_FAILURES_PER_ADDRESS", default=50)
LLMGW_LOGIN_WINDOW = env.int("LLMGW_LOGIN_WINDOW", default=900)

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
# The web process serves the static files itself unless a proxy in front does.
LLMGW_SERVE_STATIC = env.bool("LLMGW_SERVE_STATIC", default=True)
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

# --- Celery -----------------------------------------------------------------

CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default="filesystem://")
_broker_dir = DATA_DIR / "broker"
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "queue"),
        "data_folder_out": str(_broker_dir / "queue"),
        "processed_folder": str(_broker_dir / "processed"),
        # kombu's default is "control" relative to the working directory.
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
else:
    # acks_late tasks must finish well inside the visibility timeout, or Redis
    # hands them to a second worker.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 3600}
    if CELERY_BROKER_URL.startswith(("redis://", "rediss://")):
        CELERY_BROKER_TRANSPORT = "llmgw_site.celery:Transport"  # a worker survives Redis going away
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_ACKS_LATE = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

# --- Liveness ---------------------------------------------------------------

_redis_default = CELERY_BROKER_URL if CELERY_BROKER_URL.startswith("redis") else ""
LLMGW_REDIS_URL = env.str("LLMGW_REDIS_URL", default=_redis_default)

# The login throttle's counts: shared by every web process (Redis), or by the
# processes of the one host of the embedded default (files).
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "throttle": (
        {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": LLMGW_REDIS_URL}
        if LLMGW_REDIS_URL else
        {"BACKEND": "django.core.cache.backends.filebased.FileBasedCache", "LOCATION": str(DATA_DIR / "throttle")}
    ),
}

# --- llmgw ------------------------------------------------------------------

LLMGW_NODE_GRACE = env.float("LLMGW_NODE_GRACE", default=60.0)
LLMGW_HEARTBEAT_INTERVAL = env.float("LLMGW_HEARTBEAT_INTERVAL", default=5.0)
# GPU health (docs/gpus.md): a GPU at or over this temperature (°C) is degraded;
# so is one with this many corrected ECC errors between two readings.
LLMGW_GPU_TEMP_DEGRADED = env.int("LLMGW_GPU_TEMP_DEGRADED", default=87)
LLMGW_GPU_ECC_STORM = env.int("LLMGW_GPU_ECC_STORM", default=100)
# Opt-in: a quarantined GPU that NVML shows reset and healthy goes back in service by itself.
LLMGW_GPU_AUTO_CLEAR = env.bool("LLMGW_GPU_AUTO_CLEAR", default=False)
# One history sample per node at most this often (seconds); an hour of them is kept.
LLMGW_GPU_HISTORY_STEP = env.float("LLMGW_GPU_HISTORY_STEP", default=30.0)
LLMGW_SWEEP_INTERVAL = env.float("LLMGW_SWEEP_INTERVAL", default=2.0)
# The periodic reconcile; changes also trigger one at once.
LLMGW_RECONCILE_INTERVAL = env.float("LLMGW_RECONCILE_INTERVAL", default=5.0)
# A stopping replica (scaled down, drained) leaves the routing table at once and
# keeps running until its in-flight requests finish, at most this long.
LLMGW_STOP_GRACE = env.float("LLMGW_STOP_GRACE", default=60.0)
# How long the gateways take to see a routing change.
LLMGW_ROUTING_SETTLE = env.float("LLMGW_ROUTING_SETTLE", default=1.5)
# Autoscaling (replicas/autoscaling): beat looks at every autoscaled model this
# often; reading one engine's /metrics gives up after the timeout.
LLMGW_AUTOSCALE_INTERVAL = env.float("LLMGW_AUTOSCALE_INTERVAL", default=2.0)
LLMGW_AUTOSCALE_ENGINE_TIMEOUT = env.float("LLMGW_AUTOSCALE_ENGINE_TIMEOUT", default=0.5)
# Moving a replica that shares a node with another of its model to where it
# shares less (replicas/respread.py), one at a time on a quiet cluster.
LLMGW_SPREAD = env.bool("LLMGW_SPREAD", default=True)
# Ports given to engines on each node (HTTP and rendezvous of each leader).
# Move smaller replicas to make room for a pending one (replicas/moves.py),
# at most this many at once; LLMGW_DEFRAG=0 keeps every placement where it is.
LLMGW_DEFRAG = env.bool("LLMGW_DEFRAG", default=True)
LLMGW_DEFRAG_MAX_MOVES = env.int("LLMGW_DEFRAG_MAX_MOVES", default=2)
# A rollout fails (the old revision keeps serving) once this many replicas of
# the new revision failed before becoming ready (replicas/rollout.py).
LLMGW_ROLLOUT_MAX_FAILURES = env.int("LLMGW_ROLLOUT_MAX_FAILURES", default=3)
# A rollout to new weights fails (the old revision keeps serving) when a node
# staging them keeps an error this many seconds (replicas/rollout_weights.py).
LLMGW_ROLLOUT_STAGING_GRACE = env.float("LLMGW_ROLLOUT_STAGING_GRACE", default=60.0)
# A staging replica whose node made no progress fetching its weights this many
# seconds fails, and a replacement is placed elsewhere (replicas.weights_cache);
# that node is not chosen for the same weights again for as long.
LLMGW_STAGING_TIMEOUT = env.float("LLMGW_STAGING_TIMEOUT", default=900.0)
# A replica fails once an engine of it failed at start this many times (its
# agent restarts it with a growing delay in between: crash-loop backoff).
LLMGW_ENGINE_START_ATTEMPTS = env.int("LLMGW_ENGINE_START_ATTEMPTS", default=5)
# Model weights (replicas/weights.py, docs/weights.md): the Hugging Face
# endpoint a catalog source of kind hf reads (the hub, or a mirror inside the
# cluster), its token (private repositories), and how long resolving a source
# at apply may take.
LLMGW_HF_ENDPOINT = env.str("LLMGW_HF_ENDPOINT", default="https://huggingface.co").rstrip("/")
LLMGW_HF_TOKEN = (Path(env.str("LLMGW_HF_TOKEN_FILE")).read_text().strip()
                  if env.str("LLMGW_HF_TOKEN_FILE", default="") else env.str("LLMGW_HF_TOKEN", default=""))
LLMGW_WEIGHTS_RESOLVE_TIMEOUT = env.float("LLMGW_WEIGHTS_RESOLVE_TIMEOUT", default=30.0)
# Air-gapped: refuse sources of kind hf or http whose host is not one of
# these (comma-separated; empty: any host).
LLMGW_WEIGHTS_ALLOWED_HOSTS = env.list("LLMGW_WEIGHTS_ALLOWED_HOSTS", default=[])
LLMGW_PORT_MIN = env.int("LLMGW_PORT_MIN", default=20000)
LLMGW_PORT_MAX = env.int("LLMGW_PORT_MAX", default=29999)
# A gap this long in the control plane's own hearing (agent API or sweep not
# running) gives every node a fresh grace period.
LLMGW_DEAF_AFTER = env.float("LLMGW_DEAF_AFTER", default=max(5.0, 3 * LLMGW_SWEEP_INTERVAL))
# More than this fraction of live nodes silent at once (and at least two) looks
# like the control plane's own network: failovers are held. 1 disables.
LLMGW_MASS_SILENCE_FRACTION = env.float("LLMGW_MASS_SILENCE_FRACTION", default=0.5)
# The backoff cap the agents are told (``HeartbeatReply.reconnect_max``): once
# the control plane hears again after an outage, every agent retries within
# it. 0 (the default): as long as fits the grace period, grace minus one
# heartbeat interval, at most 30 s.
LLMGW_AGENT_RECONNECT_MAX = env.float("LLMGW_AGENT_RECONNECT_MAX", default=0.0)
LLMGW_MAX_HEARTBEAT_BYTES = env.int("LLMGW_MAX_HEARTBEAT_BYTES", default=256 * 1024)
LLMGW_REVOCATION_CACHE_SECONDS = env.float("LLMGW_REVOCATION_CACHE_SECONDS", default=1.0)
LLMGW_CERT_DAYS = env.int("LLMGW_CERT_DAYS", default=365)
# Node certificates signed from a node's own request (onboarding, rotation):
# short-lived; the agent renews at two thirds of the lifetime.
LLMGW_NODE_CERT_DAYS = env.int("LLMGW_NODE_CERT_DAYS", default=30)
# A lifetime in seconds instead (above zero): for trying rotation out.
LLMGW_NODE_CERT_SECONDS = env.int("LLMGW_NODE_CERT_SECONDS", default=0)
# An Event warns when a live node certificate is this close to expiring and
# nothing has renewed it.
# A node's certificate may be renewed once it is this old (seconds), or half
# its lifetime old if that comes first (pki.signing.renewal_wait).
LLMGW_CERT_RENEW_INTERVAL = env.float("LLMGW_CERT_RENEW_INTERVAL", default=3600.0)
LLMGW_CERT_WARN_DAYS = env.float("LLMGW_CERT_WARN_DAYS", default=7.0)

DATA_UPLOAD_MAX_MEMORY_SIZE = LLMGW_MAX_HEARTBEAT_BYTES

# --- agent API listener (agentapi/) -------------------------------------------

# Seconds a client gets to finish its TLS handshake.
LLMGW_AGENT_HANDSHAKE_TIMEOUT = env.float("LLMGW_AGENT_HANDSHAKE_TIMEOUT", default=10.0)
# Seconds a request (head and body) may take to arrive whole, from its first
# byte; also the bound on each write of an answer.
LLMGW_AGENT_REQUEST_TIMEOUT = env.float("LLMGW_AGENT_REQUEST_TIMEOUT", default=30.0)
# Seconds a verified connection may stay open with no request started: longer
# than the heartbeat interval, so that heartbeats reuse their connection.
LLMGW_AGENT_IDLE_TIMEOUT = env.float("LLMGW_AGENT_IDLE_TIMEOUT", default=75.0)
# Connections one certificate may hold open in each agent API worker process
# (an agent uses two: heartbeats and the desired-state long-poll).
LLMGW_AGENT_CONNECTIONS_PER_CERT = env.int("LLMGW_AGENT_CONNECTIONS_PER_CERT", default=4)
LLMGW_AGENT_LOG_LEVEL = env.str("LLMGW_AGENT_LOG_LEVEL", default="info")
# Any value turns gunicorn's access log on.
LLMGW_AGENT_ACCESS_LOG = bool(env.str("LLMGW_AGENT_ACCESS_LOG", default=""))

# --- web port (web/protocol.py) ---------------------------------------------------

# The request head (request line and headers), bounded before any
# authentication: larger heads, or more headers, are answered 431; a head not
# whole this many seconds after its first byte (or after the connection
# opened) is answered 408 and the connection closed.
LLMGW_WEB_MAX_HEAD_BYTES = env.int("LLMGW_WEB_MAX_HEAD_BYTES", default=32 * 1024)
LLMGW_WEB_MAX_HEADERS = env.int("LLMGW_WEB_MAX_HEADERS", default=100)
LLMGW_WEB_HEAD_TIMEOUT = env.float("LLMGW_WEB_HEAD_TIMEOUT", default=10.0)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Django model permissions per action (roles are groups of them): accounts/permissions.py.
    "DEFAULT_PERMISSION_CLASSES": ["accounts.permissions.ActionPermissions"],
    "DEFAULT_PARSER_CLASSES": [
        "web.parsers.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_SCHEMA_CLASS": "web.schema.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": None,
    "EXCEPTION_HANDLER": "web.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "llmgw operator API",
    "DESCRIPTION": "Nodes, fabrics, certificates and events of an llmgw cluster.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from the web process itself: clusters often have no internet.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env.str("LLMGW_LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.request": {"level": "ERROR"},
        # A sweep every two seconds is not news.
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
        "celery.beat": {"level": "WARNING"},
    },
}

# --- gateway (/v1) ------------------------------------------------------------

# Keyless /v1 for the embedded demo only: every caller may use every model.
LLMGW_GATEWAY_OPEN = env.bool("LLMGW_GATEWAY_OPEN", default=False)
LLMGW_GATEWAY_CONNECT_TIMEOUT = env.float("LLMGW_GATEWAY_CONNECT_TIMEOUT", default=5.0)
# Longest silence from an engine (before its headers, or between two chunks).
LLMGW_GATEWAY_READ_TIMEOUT = env.float("LLMGW_GATEWAY_READ_TIMEOUT", default=600.0)
# Per-model defaults of the gateway's timeouts (gateway/timeouts.py; a model's catalog 'timeouts:' overrides):
# to a streamed answer's first chunk, and of the whole exchange (0: none, so long generations are never cut).
LLMGW_GATEWAY_TTFT_TIMEOUT = env.float("LLMGW_GATEWAY_TTFT_TIMEOUT", default=600.0)
LLMGW_GATEWAY_TOTAL_TIMEOUT = env.float("LLMGW_GATEWAY_TOTAL_TIMEOUT", default=0.0)
# How often each gateway process checks the routing table and publishes its in-flight counts.
LLMGW_GATEWAY_SYNC_INTERVAL = env.float("LLMGW_GATEWAY_SYNC_INTERVAL", default=0.2)
LLMGW_GATEWAY_MAX_BODY_BYTES = env.int("LLMGW_GATEWAY_MAX_BODY_BYTES", default=32 * 1024 * 1024)
# Seconds a client has to send the whole body once its headers (and key) passed.
LLMGW_GATEWAY_BODY_TIMEOUT = env.float("LLMGW_GATEWAY_BODY_TIMEOUT", default=60.0)
# Bodies larger than this are parsed in separate processes, at most this many at once per web process.
LLMGW_GATEWAY_INLINE_PARSE_BYTES = env.int("LLMGW_GATEWAY_INLINE_PARSE_BYTES", default=256 * 1024)
LLMGW_GATEWAY_PARSE_WORKERS = env.int("LLMGW_GATEWAY_PARSE_WORKERS", default=2)
# Scrapers of /metrics send 'Authorization: Bearer <token>'. Unset, /metrics
# answers loopback callers only (a Prometheus on the same host, the demo).
LLMGW_METRICS_TOKEN = env.str("LLMGW_METRICS_TOKEN", default="")
if env.str("LLMGW_METRICS_TOKEN_FILE", default=""):
    LLMGW_METRICS_TOKEN = Path(env.str("LLMGW_METRICS_TOKEN_FILE")).read_text().strip()
LLMGW_GATEWAY_RETRY_AFTER = env.int("LLMGW_GATEWAY_RETRY_AFTER", default=2)
# Tokens a request with limits reserves for its completion when it does not say max_tokens (gateway/limits.py);
# settled to what the engine reports when the answer ends.
LLMGW_LIMITS_COMPLETION_ESTIMATE = env.int("LLMGW_LIMITS_COMPLETION_ESTIMATE", default=256)
# What a new key gets for each limit, its priority and lifetime when whoever creates it does not say
# (gateway.services.key_create; LiteLLM's default_key_generate_params): stored on the key, so a default
# changed later applies to keys created after it only. 0 or unset: no limit, never expires.
_KEYS_DEFAULT_PROBLEMS: list[str] = []


def _keys_default(name: str, raw: str, most: int, none: str = "no limit") -> int:
    """A whole number from 0 to ``most`` (what the key's column holds); anything else is noted and refused
    by name below (environ's own int() would fail with a traceback that does not say which setting)."""
    try:
        value = int(raw.strip() or 0)
    except ValueError:
        value = -1
    if not 0 <= value <= most:
        _KEYS_DEFAULT_PROBLEMS.append(f"{name}={raw!r} must be a whole number from 0 to {most} "
                                      f"(0 or unset: {none}); correct it or unset it")
        return 0
    return value


_INT, _BIGINT = 2**31 - 1, 2**63 - 1
LLMGW_KEYS_DEFAULT_RPM = _keys_default(
    "LLMGW_KEYS_DEFAULT_RPM", env.str("LLMGW_KEYS_DEFAULT_RPM", default=""), _INT)
LLMGW_KEYS_DEFAULT_TPM = _keys_default(
    "LLMGW_KEYS_DEFAULT_TPM", env.str("LLMGW_KEYS_DEFAULT_TPM", default=""), _INT)
LLMGW_KEYS_DEFAULT_MAX_CONCURRENT = _keys_default(
    "LLMGW_KEYS_DEFAULT_MAX_CONCURRENT", env.str("LLMGW_KEYS_DEFAULT_MAX_CONCURRENT", default=""), _INT)
LLMGW_KEYS_DEFAULT_DAILY_TOKENS = _keys_default(
    "LLMGW_KEYS_DEFAULT_DAILY_TOKENS", env.str("LLMGW_KEYS_DEFAULT_DAILY_TOKENS", default=""), _BIGINT)
LLMGW_KEYS_DEFAULT_MONTHLY_TOKENS = _keys_default(
    "LLMGW_KEYS_DEFAULT_MONTHLY_TOKENS", env.str("LLMGW_KEYS_DEFAULT_MONTHLY_TOKENS", default=""), _BIGINT)
LLMGW_KEYS_DEFAULT_EXPIRES_DAYS = _keys_default(
    "LLMGW_KEYS_DEFAULT_EXPIRES_DAYS", env.str("LLMGW_KEYS_DEFAULT_EXPIRES_DAYS", default=""), 36500,
    none="never expires")
LLMGW_KEYS_DEFAULT_PRIORITY = env.str("LLMGW_KEYS_DEFAULT_PRIORITY", default="standard").strip()
# The gateway's queue for a model whose every replica is at capacity (gateway/queue.py): most waiting per
# model and process (then 429), longest wait (then 503), the engine queue allowed beyond its batch limit, and
# the share of a replica's capacity batch keys leave to interactive and standard ones.
LLMGW_GATEWAY_QUEUE_MAX = env.int("LLMGW_GATEWAY_QUEUE_MAX", default=1000)
LLMGW_GATEWAY_QUEUE_WAIT = env.float("LLMGW_GATEWAY_QUEUE_WAIT", default=60.0)
LLMGW_GATEWAY_ENGINE_QUEUE = env.int("LLMGW_GATEWAY_ENGINE_QUEUE", default=0)
LLMGW_GATEWAY_BATCH_HEADROOM = env.float("LLMGW_GATEWAY_BATCH_HEADROOM", default=0.1)
# Connections kept to engines per gateway process (0: no limit).
LLMGW_GATEWAY_MAX_CONNECTIONS = env.int("LLMGW_GATEWAY_MAX_CONNECTIONS", default=0)
# Engine load: each web process reads its replicas' /metrics every this many
# seconds, at most this many reads a second (more replicas: each read less often).
LLMGW_GATEWAY_ENGINE_SCRAPE_INTERVAL = env.float("LLMGW_GATEWAY_ENGINE_SCRAPE_INTERVAL", default=1.0)
LLMGW_GATEWAY_ENGINE_SCRAPES_PER_SECOND = env.float("LLMGW_GATEWAY_ENGINE_SCRAPES_PER_SECOND", default=200.0)
# Routing policies' knobs (docs/gateway.md#routing-policies; gateway.scoring, gateway.prefix).
LLMGW_ROUTING_BLOCK_CHARS = env.int("LLMGW_ROUTING_BLOCK_CHARS", default=512)
LLMGW_ROUTING_MAX_BLOCKS = env.int("LLMGW_ROUTING_MAX_BLOCKS", default=128)
LLMGW_ROUTING_CHARS_PER_TOKEN = env.float("LLMGW_ROUTING_CHARS_PER_TOKEN", default=4.0)
LLMGW_ROUTING_CACHE_TOKENS = env.int("LLMGW_ROUTING_CACHE_TOKENS", default=262_144)
LLMGW_ROUTING_PREFIX_WEIGHT = env.float("LLMGW_ROUTING_PREFIX_WEIGHT", default=3.0)
LLMGW_ROUTING_QUEUE_WEIGHT = env.float("LLMGW_ROUTING_QUEUE_WEIGHT", default=2.0)
LLMGW_ROUTING_KV_WEIGHT = env.float("LLMGW_ROUTING_KV_WEIGHT", default=2.0)
LLMGW_ROUTING_BALANCE_ABS = env.int("LLMGW_ROUTING_BALANCE_ABS", default=8)
LLMGW_ROUTING_BALANCE_REL = env.float("LLMGW_ROUTING_BALANCE_REL", default=1.5)
LLMGW_ROUTING_PREFILL_WEIGHT = env.float("LLMGW_ROUTING_PREFILL_WEIGHT", default=1.0)
LLMGW_ROUTING_DECODE_WEIGHT = env.float("LLMGW_ROUTING_DECODE_WEIGHT", default=0.1)
LLMGW_ROUTING_SHARE_INTERVAL = env.float("LLMGW_ROUTING_SHARE_INTERVAL", default=0.25)
# The web processes of one machine add up their /metrics figures through files
# here (prometheus_client's multiprocess mode). prometheus_client takes the
# directory from its environment variable when it is imported, hence the
# assignment: settings load before any app module.
LLMGW_METRICS_DIR = Path(env.str("LLMGW_METRICS_DIR", default=str(DATA_DIR / "metrics"))).resolve()
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(LLMGW_METRICS_DIR)

# --- provisioning (Proxmox VMs) -----------------------------------------------

# Per request to a hypervisor; proxmoxer's own 5 s is shorter than a create
# waiting on a config lock.
LLMGW_PROXMOX_TIMEOUT = env.float("LLMGW_PROXMOX_TIMEOUT", default=60.0)
# How long a job waits for one Proxmox task, for an unanswering hypervisor,
# and for SSH on a new VM.
LLMGW_PROVISION_TASK_DEADLINE = env.float("LLMGW_PROVISION_TASK_DEADLINE", default=900.0)
LLMGW_PROVISION_UNREACHABLE_DEADLINE = env.float("LLMGW_PROVISION_UNREACHABLE_DEADLINE", default=300.0)
LLMGW_PROVISION_SSH_DEADLINE = env.float("LLMGW_PROVISION_SSH_DEADLINE", default=600.0)
LLMGW_PROVISION_SSH_PORT = env.int("LLMGW_PROVISION_SSH_PORT", default=22)
# Polling a task: from this interval, doubling up to the ceiling.
LLMGW_PROVISION_POLL_MIN = env.float("LLMGW_PROVISION_POLL_MIN", default=1.0)
LLMGW_PROVISION_POLL_MAX = env.float("LLMGW_PROVISION_POLL_MAX", default=10.0)
# A worker holds a job this long per step; killed, the job resumes after it.
LLMGW_PROVISION_LEASE = env.float("LLMGW_PROVISION_LEASE", default=300.0)
# A job whose next advance is this late is enqueued again by the sweep.
LLMGW_PROVISION_STALL_GRACE = env.float("LLMGW_PROVISION_STALL_GRACE", default=30.0)
# Onboarding: the agent API's address as nodes reach it (written into their
# agent.yaml), and how long to wait for a new node's first heartbeat.
LLMGW_AGENT_SERVER = env.str("LLMGW_AGENT_SERVER", default="https://127.0.0.1:7443")
def _loopback_server() -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    host = urlsplit(LLMGW_AGENT_SERVER).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# A node's mgmt_addr is where the gateway sends requests. A loopback address
# there would point the gateway at itself; it is a node's address only on a
# cluster of one machine, which is what an agent API reached on loopback
# means (llmgw up, the demo, simulated clusters). Host names instead of
# addresses only where a deployment says so (security.md).
LLMGW_ALLOW_LOOPBACK_NODES = env.bool("LLMGW_ALLOW_LOOPBACK_NODES", default=_loopback_server())
LLMGW_NODE_HOSTNAMES = env.bool("LLMGW_NODE_HOSTNAMES", default=False)
# The user engines run as on onboarded nodes: created there, named in agent.yaml.
LLMGW_ENGINE_USER = env.str("LLMGW_ENGINE_USER", default="llmgw-engine")
LLMGW_ONBOARD_HEARTBEAT_DEADLINE = env.float("LLMGW_ONBOARD_HEARTBEAT_DEADLINE", default=120.0)
LLMGW_ONBOARD_CLOCK_SKEW = env.float("LLMGW_ONBOARD_CLOCK_SKEW", default=60.0)
LLMGW_PROVISION_SWEEP_INTERVAL = env.float("LLMGW_PROVISION_SWEEP_INTERVAL", default=15.0)

# --- settings that must work together ------------------------------------------


def _timing_problems() -> list[str]:
    grace, interval, sweep = LLMGW_NODE_GRACE, LLMGW_HEARTBEAT_INTERVAL, LLMGW_SWEEP_INTERVAL
    problems = []
    for name, value in (("LLMGW_HEARTBEAT_INTERVAL", interval), ("LLMGW_SWEEP_INTERVAL", sweep),
                        ("LLMGW_NODE_GRACE", grace), ("LLMGW_DEAF_AFTER", LLMGW_DEAF_AFTER)):
        if value <= 0:
            problems.append(f"{name}={value:g} must be more than 0 seconds")
    if problems:
        return problems
    if grace < 2 * interval:
        problems.append(
            f"LLMGW_NODE_GRACE={grace:g} is shorter than two heartbeat intervals "
            f"(LLMGW_HEARTBEAT_INTERVAL={interval:g}): a node missing one heartbeat would be declared lost. "
            f"Make the grace at least {2 * interval:g}s or the interval at most {grace / 2:g}s"
        )
    if LLMGW_DEAF_AFTER < max(2.0, 2 * sweep):
        problems.append(
            f"LLMGW_DEAF_AFTER={LLMGW_DEAF_AFTER:g} is shorter than two sweeps (LLMGW_SWEEP_INTERVAL={sweep:g}) "
            "or 2s: every ordinary gap between sweeps would look like an outage of the control plane and "
            f"give every node a fresh grace period, so none would ever be declared lost. Make it at least "
            f"{max(2.0, 2 * sweep):g}s"
        )
    reconnect = LLMGW_AGENT_RECONNECT_MAX
    if reconnect < 0:
        problems.append(f"LLMGW_AGENT_RECONNECT_MAX={reconnect:g} must be 0 (derived) or more")
    elif reconnect and reconnect + interval > grace:
        problems.append(
            f"LLMGW_AGENT_RECONNECT_MAX={reconnect:g} plus a heartbeat interval ({interval:g}s) is longer than "
            f"LLMGW_NODE_GRACE={grace:g}: an agent backing off after a network blip, or after the control "
            "plane's own outage, could retry only after its node was declared lost. Make it at most "
            f"{grace - interval:g}s, or leave it unset"
        )
    return problems


if _timing_problems():
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("settings that cannot work together:\n  - " + "\n  - ".join(_timing_problems()))


def _keys_default_problems() -> list[str]:
    from gateway.choices import Priority

    problems = list(_KEYS_DEFAULT_PROBLEMS)
    if LLMGW_KEYS_DEFAULT_PRIORITY not in Priority.values:
        problems.append(f"LLMGW_KEYS_DEFAULT_PRIORITY={LLMGW_KEYS_DEFAULT_PRIORITY!r} is not a priority class: "
                        f"use one of {', '.join(Priority.values)}, or unset it (standard)")
    return problems


if _keys_default_problems():
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("defaults of new API keys that cannot work:\n  - "
                               + "\n  - ".join(_keys_default_problems()))
