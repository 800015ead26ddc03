"""The per-process state of the gateway: routing table, key cache, usage
counters, metrics, the pooled HTTP client, and the background task that keeps
them in step with the database.

Nothing on the request path touches the database: a task polls the routing
version (``selectors.routing_version``) every ``LLMGW_GATEWAY_SYNC_INTERVAL``
(0.2 s), reloads the table when it moves, publishes this process's in-flight
counts for drains and for the other processes' queues (reading theirs back),
and adds the keys' usage in batches. The database work runs on one thread of
its own, so it never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import hashlib
import logging
import os
import secrets
import socket
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import redis
from django.conf import settings
from django.db import close_old_connections

from . import inflight, selectors, services
from .bodycheck import Checker, Hashing
from .engineload import REDIS_KEY as ENGINE_READINGS_KEY, EngineScraper
from .metrics import GatewayMetrics
from .hold import Holds, RedisPlaces
from .limits import LocalLimiter, RedisLimiter
from .prefixshare import PrefixShare
from .load_report import LoadReport
from .routing import CACHE_AWARE, Key, RoutingTable, key_of
from .queue import GatewayQueue, QueueSettings
from .scoring import Knobs
from .timeouts import Timeouts
from .upstream import Pool
from .services import KEY_PREFIX

logger = logging.getLogger(__name__)

# A full reload now and then, whatever the routing version says (a node's address may change).
FULL_RELOAD_EVERY = 5.0
PUBLISH_AT_LEAST_EVERY = 1.0
USAGE_FLUSH_EVERY = 2.0
# How often a process deletes the records of processes long gone.
PRUNE_EVERY = 30.0
# A sync a batch waiter asked for (gateway.queue's nudge) comes at least this long after the last one ended:
# soon for one waiter, and not a sync per arrival in a flood.
NUDGED_SYNC_GAP = 0.02
CLUSTER_GAUGES_MAX_AGE = 1.0
# A key the table does not know is looked up once in the database (a key made
# since the last reload works on its first request). A wrong one is then
# remembered for a while, in a bounded cache, and the lookups themselves are
# rate-limited, so that a flood of wrong keys, the same or all different,
# cannot hammer the database: past the limit an unknown key is refused as
# before, and works once the next reload (0.2 s) brings it.
UNKNOWN_KEY_TTL = 10.0
UNKNOWN_KEYS_MAX = 10_000
KEY_LOOKUPS_PER_SECOND = 20.0


class Gateway:
    def __init__(self) -> None:
        self.name = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.table = RoutingTable(
            Knobs(prefix_weight=settings.LLMGW_ROUTING_PREFIX_WEIGHT, queue_weight=settings.LLMGW_ROUTING_QUEUE_WEIGHT,
                  kv_weight=settings.LLMGW_ROUTING_KV_WEIGHT, balance_abs=settings.LLMGW_ROUTING_BALANCE_ABS,
                  balance_rel=settings.LLMGW_ROUTING_BALANCE_REL, prefill_weight=settings.LLMGW_ROUTING_PREFILL_WEIGHT,
                  decode_weight=settings.LLMGW_ROUTING_DECODE_WEIGHT),
            block_chars=settings.LLMGW_ROUTING_BLOCK_CHARS, chars_per_token=settings.LLMGW_ROUTING_CHARS_PER_TOKEN,
            cache_tokens=settings.LLMGW_ROUTING_CACHE_TOKENS,
        )
        # The models whose prompts are hashed into prefix blocks (None: none), from the table.
        self.hashing: Hashing | None = None
        self.scraper = EngineScraper(interval=settings.LLMGW_GATEWAY_ENGINE_SCRAPE_INTERVAL,
                                     per_second=settings.LLMGW_GATEWAY_ENGINE_SCRAPES_PER_SECOND,
                                     timeout=min(2.0, settings.LLMGW_GATEWAY_CONNECT_TIMEOUT))
        self._scrape_task: asyncio.Task | None = None
        # The cache-aware prefix memory shared with the other web processes (Redis only).
        self.share: PrefixShare | None = None
        if settings.LLMGW_REDIS_URL and settings.LLMGW_ROUTING_SHARE_INTERVAL > 0:
            self.share = PrefixShare(redis.Redis.from_url(settings.LLMGW_REDIS_URL, socket_timeout=2,
                                                          socket_connect_timeout=2))
            self.table.share = self.share
        self._share_task: asyncio.Task | None = None
        self._share_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-prefix-share")
        # Autoscaling: requests held for a model that is starting, and this process's load per model.
        self.holds = Holds(RedisPlaces(settings.LLMGW_REDIS_URL, self.name) if settings.LLMGW_REDIS_URL else None)
        self.load = LoadReport()
        self.metrics = GatewayMetrics()
        self.open = settings.LLMGW_GATEWAY_OPEN
        # key id -> [requests, prompt tokens, completion tokens], not yet in the database
        self.usage: dict[int, list[int]] = {}
        # (key id, model, unix hour) -> [requests, prompt tokens, completion tokens] as engines reported them
        self.usage_hours: dict[tuple[int, str, int], list[int]] = {}
        self.queue = GatewayQueue(QueueSettings(
            most=settings.LLMGW_GATEWAY_QUEUE_MAX, wait=settings.LLMGW_GATEWAY_QUEUE_WAIT,
            engine_queue=settings.LLMGW_GATEWAY_ENGINE_QUEUE, batch_headroom=settings.LLMGW_GATEWAY_BATCH_HEADROOM))
        self._model_timeouts: dict[str, dict] = {}
        self._timeouts: dict[str, Timeouts] = {}
        self.limiter = RedisLimiter(settings.LLMGW_REDIS_URL) if settings.LLMGW_REDIS_URL else LocalLimiter()
        # The client of forwarded requests (gateway.upstream); aiohttp's session below reads engines' /metrics.
        self.upstream = Pool(limit=settings.LLMGW_GATEWAY_MAX_CONNECTIONS)
        self.session: aiohttp.ClientSession | None = None
        self.started = False
        self._starting: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-db")
        self.bodies = Checker(inline_bytes=settings.LLMGW_GATEWAY_INLINE_PARSE_BYTES,
                              workers=settings.LLMGW_GATEWAY_PARSE_WORKERS)
        self._version: tuple | None = None
        self._loaded_at = 0.0
        self._published: tuple | None = None
        self._peers = bool(settings.LLMGW_REDIS_URL)  # the other processes' records are read back (Redis only)
        self._sync_soon = asyncio.Event()
        self._synced_at = 0.0
        if self._peers:
            self.queue.nudge = self._sync_soon.set
        self._published_at = 0.0
        self._flushed_at = time.monotonic()
        self._pruned_at = 0.0
        self._cluster: tuple[float, dict | None] = (0.0, None)
        self._last_sync_error = 0.0
        self._unknown_keys: OrderedDict[str, float] = OrderedDict()  # secret hash -> remembered until
        self._key_lookups: dict[str, asyncio.Future] = {}
        self._lookup_tokens, self._lookup_at = KEY_LOOKUPS_PER_SECOND, time.monotonic()

    # --- life ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the routing table and start syncing; concurrent callers share one start."""
        if self.started:
            return
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except Exception:
            if self._starting is starting:
                self._starting = None  # the next request tries again
            raise

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        snapshot = await loop.run_in_executor(self._db, self._poll, True)
        self._apply(snapshot)
        if self.session is None:
            limit = settings.LLMGW_GATEWAY_MAX_CONNECTIONS
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60)
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=settings.LLMGW_GATEWAY_CONNECT_TIMEOUT,
                sock_read=settings.LLMGW_GATEWAY_READ_TIMEOUT,
            )
            # Engines answer uncompressed: what they send is passed on untouched.
            # No cookie jar: one engine's cookie must never reach another client.
            self.session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
        self._task = loop.create_task(self._sync_forever(), name="gateway-sync")
        if self.scraper.interval > 0:
            self._scrape_task = loop.create_task(self._scrape_forever(), name="gateway-engine-metrics")
        if self.share is not None:
            self._share_task = loop.create_task(self._share_forever(), name="gateway-prefix-share")
        self.started = True
        atexit.register(self._at_exit)
        # Everything loaded so far (Django, the apps, the table) lives as long
        # as the process: out of the collector's sight, a full collection no
        # longer walks it. (It did, every few hundred requests: a quarter of a
        # plain request's CPU, measured with bench/gateway_profile.py.)
        gc.collect()
        gc.freeze()
        logger.info("gateway started process=%s models=%d ready_replicas=%d keys=%d open=%s", self.name,
                    len(self.table.catalog), len(self.table.routed_ids()), len(self.table.keys), self.open)

    async def stop(self) -> None:
        for name in ("_share_task", "_scrape_task", "_task"):
            task = getattr(self, name)
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                setattr(self, name, None)
        if self.session is not None:
            await self.session.close()
            self.session = None
        self.upstream.close()
        try:
            await self.limiter.close()
        except Exception:
            logger.warning("gateway limiter did not close cleanly", exc_info=True)
        try:
            await self.holds.close()
        except Exception:
            logger.warning("gateway held-request places did not close cleanly", exc_info=True)
        self.bodies.close()
        if self.started:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._db, self._final_writes)
            self.started = False

    def _at_exit(self) -> None:
        # For servers that exit normally without lifespan events. (uvicorn
        # ends a SIGTERM by raising it again with the default handler: there,
        # only lifespan events, as 'llmgw up' enables, let the last counts out.)
        if self.started:
            self._final_writes()

    def _final_writes(self) -> None:
        usage, self.usage = self.usage, {}
        hours, self.usage_hours = self.usage_hours, {}
        try:
            if usage or hours:
                services.key_usage_flush(usage={k: tuple(v) for k, v in usage.items()},
                                         hours={k: tuple(v) for k, v in hours.items()})
            services.gateway_process_forget(name=self.name)
            self.load.forget(self)
        except Exception:
            logger.exception("gateway could not write its last usage counts")

    # --- keys and usage -----------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Key | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        token = authorization[7:].strip()
        if not token:
            return None
        return self.table.keys.get(hashlib.sha256(token.encode()).hexdigest())

    async def authenticate_or_look_up(self, authorization: str | None) -> Key | None:
        """``authenticate``, and for a well-formed key the table does not know, one
        lookup in the database (shared by concurrent requests with that key)."""
        key = self.authenticate(authorization)
        if key is not None or not authorization or not authorization.startswith(f"Bearer {KEY_PREFIX}"):
            return key
        token = authorization[7:].strip()
        if len(token) > 200:
            return None
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        if self._unknown_keys.get(digest, 0.0) > now:
            return None
        pending = self._key_lookups.get(digest)
        if pending is None:
            self._lookup_tokens = min(KEY_LOOKUPS_PER_SECOND,
                                      self._lookup_tokens + (now - self._lookup_at) * KEY_LOOKUPS_PER_SECOND)
            self._lookup_at = now
            if self._lookup_tokens < 1:
                return None
            self._lookup_tokens -= 1
            loop = asyncio.get_running_loop()
            pending = loop.run_in_executor(self._db, lambda: selectors.key_by_secret_hash(secret_hash=digest))
            self._key_lookups[digest] = pending
            try:
                row = await pending
            except Exception as exc:  # the database is away: refused, as without the lookup
                logger.warning("gateway key lookup failed: %s", exc)
                return None
            finally:
                self._key_lookups.pop(digest, None)
            if row is None:
                self._unknown_keys[digest] = time.monotonic() + UNKNOWN_KEY_TTL
                self._unknown_keys.move_to_end(digest)
                while len(self._unknown_keys) > UNKNOWN_KEYS_MAX:
                    self._unknown_keys.popitem(last=False)
                return None
            self.table.keys[digest] = key_of(row)
        else:
            try:
                await asyncio.shield(pending)
            except Exception:
                return None
        return self.table.keys.get(digest)

    def count(self, key: Key | None, prompt: int = 0, completion: int = 0, request: int = 1) -> None:
        if key is None:
            return
        row = self.usage.get(key.id)
        if row is None:
            self.usage[key.id] = [request, prompt, completion]
        else:
            row[0] += request
            row[1] += prompt
            row[2] += completion

    def count_hour(self, key: Key, model: str, prompt: int, completion: int) -> None:
        """One answered request of ``key`` on ``model``, with the tokens its engine reported."""
        slot = (key.id, model, int(time.time() // 3600))
        row = self.usage_hours.get(slot)
        if row is None:
            self.usage_hours[slot] = [1, prompt, completion]
        else:
            row[0] += 1
            row[1] += prompt
            row[2] += completion

    # --- sync with the database ---------------------------------------------------------

    def _poll(self, force: bool = False) -> selectors.RoutingSnapshot | None:
        """On the database thread: the new snapshot, or None when nothing moved."""
        version = selectors.routing_version()
        now = time.monotonic()
        if not force and version == self._version and now - self._loaded_at < FULL_RELOAD_EVERY:
            return None
        snapshot = selectors.routing_snapshot()
        self._version, self._loaded_at = version, now
        return snapshot

    async def _sync_forever(self) -> None:
        loop = asyncio.get_running_loop()
        interval = settings.LLMGW_GATEWAY_SYNC_INTERVAL
        soon = self._sync_soon
        while True:
            try:
                async with asyncio.timeout(interval):
                    await soon.wait()
            except TimeoutError:
                pass
            else:  # a batch request waits on a ceiling an exchange would raise (gateway.queue)
                await asyncio.sleep(max(0.0, self._synced_at + NUDGED_SYNC_GAP - time.monotonic()))
            soon.clear()
            try:
                await self.sync_once(loop)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn_now_and_then("gateway sync failed (routing as before): %s", exc, exc_info=True)
                await loop.run_in_executor(self._db, close_old_connections)
            self._synced_at = time.monotonic()

    def _warn_now_and_then(self, message: str, exc: BaseException, *, exc_info: bool = False) -> None:
        """A background loop's failure, logged at most once per 10 s across the loops."""
        now = time.monotonic()
        if now - self._last_sync_error > 10:
            self._last_sync_error = now
            logger.warning(message, exc, exc_info=exc_info)

    async def sync_once(self, loop: asyncio.AbstractEventLoop) -> None:
        snapshot = await loop.run_in_executor(self._db, self._poll)
        if snapshot is not None:
            before = self.table.routed_ids()
            self._apply(snapshot)
            after = self.table.routed_ids()
            if before != after:
                logger.info("gateway routes changed process=%s ready_replicas=%s", self.name, after)
        if self.table.decisions:
            decisions, self.table.decisions = self.table.decisions, {}
            self.metrics.decisions(decisions, self.table.policies)
        state = (tuple(self.table.routed_ids()), tuple(sorted(self.table.inflight_counts().items())))
        now = time.monotonic()
        if self._peers:
            # With Redis, every sync also reads the other processes' records back and takes this process's
            # part of each replica's batch share, in the same round trip (gateway/queue.py).
            counts = dict(state[1])
            wants = self.queue.wants(self.table, counts)
            try:
                shares = await loop.run_in_executor(self._db, lambda: services.gateway_process_exchange(
                    name=self.name, routes=list(state[0]), inflight_counts=counts, wants=wants))
            except Exception as exc:  # the rest of the sync goes on; the queue counts on the engines' readings
                self._warn_now_and_then("gateway process record exchange failed: %s", exc)
            else:
                self.queue.shares(shares)
                for model in self.queue.waiting():  # what the new ceilings let in goes now, not at the next poll
                    self.queue.dispatch(self, model)
        elif state != self._published or now - self._published_at >= PUBLISH_AT_LEAST_EVERY:
            await loop.run_in_executor(
                self._db, lambda: services.gateway_process_publish(
                    name=self.name, routes=list(state[0]), inflight_counts=dict(state[1])))
            self._published, self._published_at = state, now
        await self.load.sync(self, loop)
        if now - self._pruned_at >= PRUNE_EVERY:
            self._pruned_at = now
            await loop.run_in_executor(self._db, services.gateway_processes_prune)
        if (self.usage or self.usage_hours) and now - self._flushed_at >= USAGE_FLUSH_EVERY:
            usage, self.usage = self.usage, {}
            hours, self.usage_hours = self.usage_hours, {}
            self._flushed_at = now

            try:
                await loop.run_in_executor(self._db, lambda: services.key_usage_flush(
                    usage={k: tuple(v) for k, v in usage.items()}, hours={k: tuple(v) for k, v in hours.items()}))
            except Exception:
                # Both batches are written in one transaction: on failure, neither was; keep them for the next flush.
                for key_id, (requests, prompt, completion) in usage.items():
                    self.count(Key(key_id, "", None), prompt, completion, requests)
                for slot, counts in hours.items():
                    row = self.usage_hours.setdefault(slot, [0, 0, 0])
                    for i in range(3):
                        row[i] += counts[i]
                raise

    def _apply(self, snapshot: selectors.RoutingSnapshot) -> None:
        self.table.apply(snapshot)
        self.queue.capacity = dict(snapshot.batch_limits)
        if snapshot.timeouts != self._model_timeouts:
            self._model_timeouts = dict(snapshot.timeouts)
            self._timeouts = {}
        hashed = frozenset(m for m, p in self.table.policies.items() if p == CACHE_AWARE)
        self.hashing = Hashing(hashed, settings.LLMGW_ROUTING_BLOCK_CHARS,
                               settings.LLMGW_ROUTING_MAX_BLOCKS) if hashed else None

    def timeouts(self, model: str) -> Timeouts:
        """The model's timeouts: its catalog entry's over the settings' defaults (made once per table load)."""
        found = self._timeouts.get(model)
        if found is None:
            found = self._timeouts[model] = Timeouts.of(self._model_timeouts.get(model))
        return found

    # --- engine load ----------------------------------------------------------------------

    async def _scrape_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = time.monotonic()
            try:
                routes = [r for routes in self.table.by_model.values() for r in routes]
                readings = await self.scraper.cycle(self.session, routes)
                failed = sum(1 for r in readings.values() if r.error)
                self.metrics.engine_reads(len(readings) - failed, failed)
                if readings and settings.LLMGW_REDIS_URL:
                    await loop.run_in_executor(self._db, self._publish_readings, readings)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn_now_and_then("gateway engine metrics cycle failed (routing on own counts): %s", exc)
            period = self.scraper.period(len(self.table.routes))
            await asyncio.sleep(max(0.05, started + period - time.monotonic()))

    async def _share_forever(self) -> None:
        """Write this process's cache-aware placements and read the others' (gateway.prefixshare)."""
        loop = asyncio.get_running_loop()
        interval = settings.LLMGW_ROUTING_SHARE_INTERVAL
        share = self.share
        while True:
            await asyncio.sleep(interval)
            wanted = self.table.shared_wanted()
            if not wanted and not share.outbox:
                continue
            try:
                found = await loop.run_in_executor(self._share_thread, self._share_once, wanted)
                self.table.apply_shared(found)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._warn_now_and_then("gateway prefix share failed (routing on this process's memory): %s", exc)

    def _share_once(self, wanted: list[tuple[str, int]]) -> list:
        self.share.flush()
        return self.share.read(wanted)

    @staticmethod
    def _publish_readings(readings: dict) -> None:
        """For the UI's replica page (any web process) and other gateways' operators: the last reading of each replica."""
        client = inflight.store().client
        pipe = client.pipeline(transaction=False)
        pipe.hset(ENGINE_READINGS_KEY, mapping={str(k): v.to_json() for k, v in readings.items()})
        pipe.expire(ENGINE_READINGS_KEY, 60)
        pipe.execute()

    async def cluster_gauges(self) -> dict | None:
        """The database's side of /metrics, at most once a second whatever the scrapers do."""
        at, gauges = self._cluster
        if gauges is not None and time.monotonic() - at < CLUSTER_GAUGES_MAX_AGE:
            return gauges
        loop = asyncio.get_running_loop()
        gauges = await loop.run_in_executor(self._db, selectors.cluster_gauges)
        self._cluster = (time.monotonic(), gauges)
        return gauges


_gateway: Gateway | None = None


def gateway() -> Gateway:
    global _gateway
    if _gateway is None:
        _gateway = Gateway()
    return _gateway
