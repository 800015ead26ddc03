"""Talking to the control plane's agent API over mTLS.

Two calls: the heartbeat (``POST .../heartbeat``, answered with the desired
state) and the desired-state long-poll (``GET .../desired?version=N&wait=S``).
Each runs on its own connection, so a long-poll waiting on the server never
delays a heartbeat. Failures become one of a few exceptions the caller can
act on: back off (unreachable, 5xx), try again soon (503: the control
plane is up but one of its dependencies is not), slow down to the slowest rate (403 and
other refusals that will not fix themselves), or stop using the long-poll
(a control plane that does not have it yet).
"""

from __future__ import annotations

import logging
import random
import ssl

import httpx
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from .config import AgentConfig
from .identity import csr_make, identity_replace
from .protocol import DesiredState, Heartbeat, HeartbeatReply, node_path

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = 5.0
REQUEST_TIMEOUT = 15.0


class ControlPlaneError(Exception):
    kind = "error"


class Unreachable(ControlPlaneError):
    kind = "unreachable"


class ServerError(ControlPlaneError):
    kind = "server error"


class Unavailable(ServerError):
    """503: the control plane is up but cannot reach its database or Redis.
    Not this node's fault and not a reason to back off further."""

    kind = "unavailable"

    def __init__(self, message: str, *, retry_after: float | None = None, dependency: str = "") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.dependency = dependency


class Refused(ControlPlaneError):
    """403: the certificate names another node, or has been revoked."""

    kind = "refused"


class Rejected(ControlPlaneError):
    """Any other 4xx: the control plane will keep saying no until something changes here."""

    kind = "rejected"


class NoLongPoll(ControlPlaneError):
    kind = "no long-poll"


def tls_context(config: AgentConfig) -> ssl.SSLContext:
    # httpx 0.28 ignores ``cert=`` when ``verify`` is a path: the client
    # certificate has to go into the context itself.
    context = ssl.create_default_context(cafile=str(config.tls.ca))
    context.load_cert_chain(str(config.tls.cert), str(config.tls.key))
    return context


class ControlPlaneClient:
    def __init__(self, config: AgentConfig) -> None:
        self.node_id = config.node_id
        self.base = config.server + node_path(config.node_id)
        context = tls_context(config)
        timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=CONNECT_TIMEOUT)
        # trust_env=False: a node's HTTP(S)_PROXY is for fetching weights, not
        # for reaching the control plane on the management network.
        self._heartbeats = httpx.Client(verify=context, timeout=timeout, trust_env=False)
        self._polls = httpx.Client(verify=context, timeout=timeout, trust_env=False)

    def heartbeat(self, heartbeat: Heartbeat) -> HeartbeatReply:
        response = self._send(self._heartbeats, "POST", f"{self.base}/heartbeat", json=heartbeat.to_dict())
        if response.status_code == 404:
            raise Rejected(
                f"{self.base}/heartbeat answered 404: 'server' in agent.yaml must be the agent API "
                "(the mTLS listener, port 7443 by default), not the web address"
            )
        self._raise_for_status(response)
        try:
            return HeartbeatReply.from_dict(response.json())
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerError(f"the heartbeat reply does not parse: {exc}") from exc

    def desired(self, *, version: int, wait: float) -> DesiredState:
        response = self._send(
            self._polls,
            "GET",
            f"{self.base}/desired",
            params={"version": version, "wait": f"{wait:g}"},
            timeout=httpx.Timeout(wait + REQUEST_TIMEOUT, connect=CONNECT_TIMEOUT),
        )
        if response.status_code in (404, 405, 501) and not _is_json_error(response):
            # The URL itself is unknown: a control plane older than the long-poll.
            raise NoLongPoll(f"the control plane has no desired-state long-poll ({response.status_code})")
        self._raise_for_status(response)
        try:
            return DesiredState.from_dict(response.json())
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerError(f"the desired state does not parse: {exc}") from exc

    def renew_certificate(self, config: AgentConfig) -> str:
        """A new identity over the current one, before it expires: a fresh key
        made here, a request for the same CN sent over mTLS, the certificate
        written beside the key, and new connections made with it. Engines are
        not touched. Returns the new certificate's serial (hex)."""
        key = ec.generate_private_key(ec.SECP256R1())
        response = self._send(self._heartbeats, "POST", f"{self.base}/certificate",
                              json={"csr": csr_make(node_id=self.node_id, key=key).decode()})
        self._raise_for_status(response)
        try:
            cert_pem = str(response.json()["certificate"]).encode()
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerError(f"the certificate reply does not parse: {exc}") from exc
        identity_replace(key_path=config.tls.key, cert_path=config.tls.cert, key=key, cert_pem=cert_pem)
        old = (self._heartbeats, self._polls)
        context = tls_context(config)
        timeout = httpx.Timeout(REQUEST_TIMEOUT, connect=CONNECT_TIMEOUT)
        self._heartbeats = httpx.Client(verify=context, timeout=timeout, trust_env=False)
        self._polls = httpx.Client(verify=context, timeout=timeout, trust_env=False)
        for client in old:
            # A long-poll parked on the old connection ends with an error and
            # is asked again over the new identity.
            client.close()
        return format(x509.load_pem_x509_certificate(cert_pem).serial_number, "x")

    def close(self) -> None:
        self._heartbeats.close()
        self._polls.close()

    @staticmethod
    def _send(client: httpx.Client, method: str, url: str, **kwargs) -> httpx.Response:
        try:
            return client.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            raise Unreachable(_transport_reason(exc)) from exc
        except httpx.HTTPError as exc:  # a malformed response, say: the server's fault
            raise ServerError(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _raise_for_status(response: httpx.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        message = _error_message(response)
        if status == 503:
            raise Unavailable(
                f"{status}: {message}", retry_after=_retry_after(response), dependency=_dependency(response)
            )
        if status >= 500:
            raise ServerError(f"{status}: {message}")
        if status == 403:
            raise Refused(message)
        raise Rejected(f"{status}: {message}")


def _is_json_error(response: httpx.Response) -> bool:
    """The agent API's own refusals are JSON with an "error"; an unknown URL is not."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and "error" in body


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict) and body.get("error"):
            details = body.get("details")
            return str(body["error"]) + (f" {details}" if details else "")
    except ValueError:
        pass
    return response.text.strip()[:300] or response.reason_phrase


def _retry_after(response: httpx.Response) -> float | None:
    """Retry-After in seconds; the HTTP-date form is not used by the agent API."""
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value >= 0 else None


def _dependency(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return ""
    return str(body.get("dependency") or "") if isinstance(body, dict) else ""


def _transport_reason(exc: httpx.TransportError) -> str:
    reason = str(exc) or type(exc).__name__
    if "CERTIFICATE_VERIFY_FAILED" in reason:
        reason += " (the server's certificate is not from tls.ca, or does not name the address in 'server')"
    return reason


class Backoff:
    """Exponential from ``base`` to ``ceiling``, with jitter so that a
    thousand agents that lost the control plane together do not come back in
    lockstep."""

    def __init__(self, base: float, ceiling: float, *, rng: random.Random | None = None) -> None:
        self.base = base
        self.ceiling = ceiling
        self.attempt = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = min(self.ceiling, self.base * (2 ** min(self.attempt, 32)))
        self.attempt += 1
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.attempt = 0


class LinkLog:
    """Logs the link to the control plane when its state changes, not on every retry."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.state: tuple[str, str] | None = None
        self.failures = 0

    def up(self) -> None:
        if self.state != ("up", ""):
            if self.state is None:
                logger.info("control plane reachable at %s", self.server)
            else:
                logger.info("control plane reachable again at %s after %d failed attempts", self.server, self.failures)
        self.state = ("up", "")
        self.failures = 0

    def failed(self, error: ControlPlaneError, *, retry_in: float) -> None:
        self.failures += 1
        # Unreachable for one reason or another is one state; a refusal that
        # changes its message is news.
        detail = str(error) if isinstance(error, (Refused, Rejected, NoLongPoll)) else ""
        if isinstance(error, Unavailable):
            detail = error.dependency
        state = (error.kind, detail)
        if state == self.state:
            logger.debug("control plane still %s (attempt %d): %s", error.kind, self.failures, error)
            return
        self.state = state
        if isinstance(error, Refused):
            logger.error(
                "control plane refused this agent (403): %s -- retrying every %.0fs; engines keep running",
                error, retry_in,
            )
        elif isinstance(error, Rejected):
            logger.error("control plane rejected the heartbeat: %s -- retrying every %.0fs", error, retry_in)
        elif isinstance(error, Unavailable):
            logger.warning(
                "control plane at %s is up but cannot serve this request: %s -- retrying every %.1fs; "
                "engines keep running", self.server, error, retry_in,
            )
        else:
            logger.warning(
                "control plane %s at %s: %s -- retrying with backoff; engines keep running",
                error.kind, self.server, error,
            )
