from django.db import models


class ErrorKind(models.TextChoices):
    """Why a /v1 request failed: the ``kind`` label of the error counter and
    the ``code`` of the OpenAI-shaped error body."""

    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    NO_READY_REPLICA = "no_ready_replica"
    MODEL_STARTING = "model_starting"  # an autoscaled model held past its bounds (gateway/hold.py)
    INVALID_REQUEST = "invalid_request"
    BODY_TOO_LARGE = "body_too_large"
    BODY_TIMEOUT = "body_timeout"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_ERROR = "upstream_error"
    STREAM_BROKEN = "stream_broken"
    CLIENT_DISCONNECTED = "client_disconnected"
    INTERNAL = "internal_error"
    RATE_LIMITED = "rate_limit_exceeded"  # a key's RPM, TPM or concurrency (gateway/limits.py)
    QUOTA_EXCEEDED = "insufficient_quota"  # a key's daily or monthly token budget
    KEY_EXPIRED = "key_expired"
    QUEUE_FULL = "queue_full"  # every replica at capacity and the gateway's queue full or waited too long


class Priority(models.TextChoices):
    """A key's class in the gateway's queue (gateway/queue.py): served in this order."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"


PRIORITY_RANK = {Priority.INTERACTIVE: 0, Priority.STANDARD: 1, Priority.BATCH: 2}


# OpenAI's error ``type`` for each HTTP status the gateway produces itself.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "requests",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}
