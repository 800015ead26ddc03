"""The running agent: four loops around one supervisor.

- supervise (main thread): applies the newest desired state, notices exits,
  stop deadlines and health, and asks for a heartbeat whenever an engine's
  state changes;
- heartbeat: every interval, or at once when asked; owns the backoff and the
  logging of the link's state;
- long-poll: waits on the control plane for the next desired state, so a
  change arrives in well under a second instead of at the next heartbeat;
- discovery: re-reads GPUs and HCAs now and then (a GPU can fall off the bus).

Nothing here stops an engine because the control plane is unreachable: until
the control plane says otherwise, what runs keeps running.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .client import (
    Backoff, ControlPlaneClient, ControlPlaneError, LinkLog, NoLongPoll, Refused, Rejected, Unavailable,
)
from .config import AgentConfig, certificate_expired
from .discovery import Inventory, discover
from .identity import IdentityError, renewal_due
from .nvml import TelemetryReader
from .protocol import DesiredState, FabricMembership, Heartbeat, Telemetry
from .supervisor import Supervisor

logger = logging.getLogger(__name__)

SUPERVISE_TICK = 0.25
LONG_POLL_WAIT = 25.0
LONG_POLL_RETRY_WITHOUT_ENDPOINT = 60.0
REDISCOVER_EVERY = 60.0
MIN_HEARTBEAT_GAP = 0.1  # a flapping engine must not turn into a heartbeat storm
# What the control plane last told this agent, kept across restarts: an agent
# restarted while the control plane is away still backs off no longer than
# the control plane expects.
TOLD_FILE = "control-plane.json"


class ReconnectCap:
    """The backoff cap in force: the configured ``reconnect_max``, or the
    shorter one the control plane asked for (it declares a node lost after a
    grace period, so an agent must retry within it once it is back)."""

    def __init__(self, config: AgentConfig) -> None:
        self.configured = config.reconnect_max
        self.path = Path(config.supervisor.work_dir) / TOLD_FILE
        self.told = 0.0
        try:
            self.told = float(json.loads(self.path.read_text()).get("reconnect_max", 0.0))
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    @property
    def value(self) -> float:
        return min(self.configured, self.told) if self.told > 0 else self.configured

    def tell(self, reconnect_max: float) -> None:
        if reconnect_max <= 0 or reconnect_max == self.told:
            return
        before = self.value
        self.told = reconnect_max
        if self.value != before:
            logger.info("the control plane asks for retries at least every %.1fs while it is away", self.value)
        try:
            self.path.write_text(json.dumps({"reconnect_max": reconnect_max}))
        except OSError as exc:
            logger.warning("cannot keep the control plane's reconnect_max in %s: %s", self.path, exc)


class DesiredHolder:
    """The newest desired state, from whichever of heartbeat or long-poll brought it.

    A reply can arrive late: a heartbeat sent before a change may be answered
    after the long-poll delivered the change. An older version is accepted
    only when the request itself already carried the version we hold, i.e.
    the control plane really went backwards (a restored database).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: DesiredState | None = None
        self._pending = False
        self.changed = threading.Event()

    @property
    def version(self) -> int:
        with self._lock:
            return self._state.version if self._state else 0

    @property
    def received(self) -> bool:
        with self._lock:
            return self._state is not None

    def offer(self, desired: DesiredState, *, asked_with: int) -> bool:
        with self._lock:
            held = self._state.version if self._state else None
            newer = held is None or desired.version > held
            went_back = held is not None and desired.version < held and asked_with == held
            if not (newer or went_back):
                return False
            if went_back:
                logger.warning("desired state went back from version %d to %d; following it", held, desired.version)
            self._state = desired
            self._pending = True
        logger.info("desired state version %d: %d member(s)", desired.version, len(desired.members))
        self.changed.set()
        return True

    def take(self) -> DesiredState | None:
        """The state to apply, once per change."""
        with self._lock:
            self.changed.clear()
            if not self._pending:
                return None
            self._pending = False
            return self._state


@dataclass
class _Sent:
    engines: tuple | None = None  # the engines snapshot the control plane has acknowledged


class Agent:
    def __init__(self, config: AgentConfig, *, client: ControlPlaneClient | None = None) -> None:
        self.config = config
        self.supervisor = Supervisor(config.supervisor)
        self.client = client or ControlPlaneClient(config)
        self._said_expired = False
        self.desired = DesiredHolder()
        self.inventory: Inventory = discover(config)
        self.link = LinkLog(config.server)
        self.reconnect = ReconnectCap(config)
        self.report_now = threading.Event()
        self.connected = threading.Event()
        self.stopping = threading.Event()
        self._sent = _Sent()
        # The newest telemetry block not yet taken by the control plane; an
        # Xid (or a GPU gone) is read and sent at once, not at the next interval.
        self._telemetry: Telemetry | None = None
        self._telemetry_lock = threading.Lock()
        self.read_telemetry_now = threading.Event()
        self.telemetry = TelemetryReader(config, on_xid=self.read_telemetry_now.set)
        self._log_inventory()

    def _log_inventory(self) -> None:
        inv = self.inventory
        logger.info(
            "node=%s gpus=%d hcas=%s fabrics=%s",
            self.config.node_id, len(inv.gpus),
            ",".join(f"{h.name}({h.fabric or '-'},{h.state or '?'})" for h in inv.hcas) or "none",
            ",".join(f.name for f in self.config.fabrics) or "none",
        )
        for error in inv.errors:
            logger.warning("discovery: %s", error)

    # --- running -------------------------------------------------------------------

    def run(self) -> None:
        adopted = [e for e in self.supervisor.engines().values() if e.adopted and not e.exited]
        if adopted:
            names = ", ".join(f"{e.name}(pid {e.pid})" for e in adopted)
            logger.info("adopted %d running engine(s): %s", len(adopted), names)
        for loop in (self._heartbeat_loop, self._long_poll_loop, self._discovery_loop, self._telemetry_loop):
            name = loop.__name__.strip("_").removesuffix("_loop")
            threading.Thread(target=self._keep_running, args=(loop,), name=name, daemon=True).start()
        try:
            self._keep_running(self._supervise_loop)
        finally:
            self.supervisor.close()
            self.telemetry.close()
            self.client.close()
            logger.info("agent stopped; engines left running for the next agent to adopt")

    def _keep_running(self, loop) -> None:
        """A bug in one loop must not leave a node silent (and declared lost)
        or its engines unwatched: log it and start the loop again."""
        while not self.stopping.is_set():
            try:
                loop()
            except Exception:  # noqa: BLE001 - see above
                logger.exception("agent loop %s failed; restarting it", loop.__name__)
                self.stopping.wait(1.0)

    def stop(self) -> None:
        self.stopping.set()
        self.report_now.set()
        self.desired.changed.set()
        self.connected.set()

    def _supervise_loop(self) -> None:
        last = None
        while not self.stopping.is_set():
            desired = self.desired.take()
            if desired is not None:
                self.supervisor.converge(desired)
            self.supervisor.tick()
            current = self.supervisor.engines_snapshot()
            if current != last:
                last = current
                self.report_now.set()
            self.desired.changed.wait(SUPERVISE_TICK)

    # --- heartbeats ------------------------------------------------------------------

    def build_heartbeat(self) -> tuple[Heartbeat, tuple]:
        snapshot = self.supervisor.engines_snapshot()
        inv = self.inventory
        # The control plane stores log tails only along with a change of
        # engine state, so steady heartbeats leave them out.
        with_logs = snapshot != self._sent.engines
        heartbeat = Heartbeat(
            agent_version=__version__,
            mgmt_addr=self.config.mgmt_addr,
            mgmt_interface=self.config.mgmt_interface,
            fabrics=[FabricMembership(name=f.name, hcas=list(f.hcas)) for f in self.config.fabrics],
            gpus=list(inv.gpus),
            hcas=list(inv.hcas),
            discovery_errors=list(inv.errors),
            engines=self.supervisor.report(with_logs=with_logs),
            desired_version=self.desired.version,
            telemetry=self._telemetry,
        )
        return heartbeat, snapshot

    def _backoff(self) -> Backoff:
        cap = self.reconnect.value
        return Backoff(min(self.config.reconnect_base, cap), cap)

    def _heartbeat_loop(self) -> None:
        backoff = self._backoff()
        interval = self.config.heartbeat_interval
        while not self.stopping.is_set():
            self.report_now.clear()
            started = time.monotonic()
            heartbeat, snapshot = self.build_heartbeat()
            asked_with = heartbeat.desired_version
            try:
                reply = self.client.heartbeat(heartbeat)
            except (Refused, Rejected) as exc:
                # It will say the same until someone changes something: ask
                # rarely, and leave the engines alone.
                self.connected.clear()
                self.link.failed(exc, retry_in=self.config.reconnect_max)
                self.stopping.wait(self.config.reconnect_max)
                continue
            except Unavailable as exc:
                # Reachable, but its database or Redis is not: nothing is
                # wrong with the link, so no backoff; try again when it says,
                # never slower than a heartbeat interval.
                self.connected.clear()
                delay = min(interval, exc.retry_after) if exc.retry_after else interval
                self.link.failed(exc, retry_in=delay)
                self.stopping.wait(max(MIN_HEARTBEAT_GAP, delay))
                continue
            except ControlPlaneError as exc:
                self.connected.clear()
                backoff.ceiling = self.reconnect.value
                self._say_if_expired()
                delay = backoff.next()
                self.link.failed(exc, retry_in=delay)
                self.stopping.wait(delay)
                continue
            self.link.up()
            backoff.reset()
            self._sent.engines = snapshot
            self._telemetry_taken(heartbeat.telemetry)
            self.connected.set()
            # Never slower than the control plane expects (it declares a
            # silent node lost by its own interval), never slower than
            # configured either.
            if reply.heartbeat_interval > 0:
                interval = min(self.config.heartbeat_interval, reply.heartbeat_interval)
            self.reconnect.tell(reply.reconnect_max)
            self.desired.offer(reply.desired, asked_with=asked_with)
            self._renew_if_due()
            self.report_now.wait(max(0.0, interval - (time.monotonic() - started)))
            self.stopping.wait(MIN_HEARTBEAT_GAP)

    def _say_if_expired(self) -> None:
        expired = certificate_expired(self.config.tls.cert)
        if expired and not self._said_expired:
            logger.error("%s", expired)
        self._said_expired = bool(expired)

    def _renew_if_due(self) -> None:
        """At two thirds of the certificate's lifetime, ask for the next one."""
        if not renewal_due(self.config.tls.cert, time.time()):
            return
        expired = certificate_expired(self.config.tls.cert)
        if expired:
            logger.error("%s", expired)
            return
        try:
            serial = self.client.renew_certificate(self.config)
        except (ControlPlaneError, IdentityError, OSError) as exc:
            logger.warning("certificate renewal failed (%s); trying again at the next heartbeat", exc)
            return
        logger.info("certificate renewed: now serial %s (engines untouched)", serial)

    # --- desired-state long-poll -------------------------------------------------------

    def _long_poll_loop(self) -> None:
        backoff = self._backoff()
        missing_logged = False
        while not self.stopping.is_set():
            # While the heartbeat cannot get through, it owns the retrying.
            if not self.connected.wait(timeout=1.0) or self.stopping.is_set():
                continue
            asked_with = self.desired.version
            try:
                desired = self.client.desired(version=asked_with, wait=LONG_POLL_WAIT)
            except NoLongPoll as exc:
                if not missing_logged:
                    logger.info("%s; desired state arrives with heartbeats instead", exc)
                    missing_logged = True
                self.stopping.wait(LONG_POLL_RETRY_WITHOUT_ENDPOINT)
                continue
            except ControlPlaneError as exc:
                logger.debug("long-poll failed: %s", exc)
                self.connected.clear()
                self.report_now.set()  # let the heartbeat find out what is wrong, and log it
                backoff.ceiling = self.reconnect.value
                if isinstance(exc, Unavailable) and exc.retry_after:
                    self.stopping.wait(min(exc.retry_after, self.reconnect.value))
                else:
                    self.stopping.wait(backoff.next())
                continue
            if missing_logged:
                logger.info("the control plane now answers the desired-state long-poll")
                missing_logged = False
            backoff.reset()
            self.desired.offer(desired, asked_with=asked_with)
            self.stopping.wait(0.01)

    # --- telemetry --------------------------------------------------------------------------

    def _telemetry_loop(self) -> None:
        interval = self.config.telemetry.interval
        while not self.stopping.is_set():
            block = self.telemetry.read()
            if block is None:
                return
            with self._telemetry_lock:
                # Xids of a block never sent stay pending in the reader and come again in this one.
                self._telemetry = block
            if any(g.xids or g.lost or g.error for g in block.gpus):
                self.report_now.set()
            self.read_telemetry_now.wait(interval)
            self.read_telemetry_now.clear()

    def _telemetry_taken(self, block: Telemetry | None) -> None:
        if block is None:
            return
        self.telemetry.sent(block)
        with self._telemetry_lock:
            if self._telemetry is block:
                self._telemetry = None

    # --- discovery ------------------------------------------------------------------------

    def _discovery_loop(self) -> None:
        while not self.stopping.wait(REDISCOVER_EVERY):
            inventory = discover(self.config)
            if inventory != self.inventory:
                self.inventory = inventory
                logger.info("inventory changed")
                self._log_inventory()
                self.report_now.set()
