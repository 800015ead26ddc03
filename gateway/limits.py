"""Per-key limits, exact across every gateway process.

A key may have requests per minute (RPM), tokens per minute (TPM, prompt +
completion), requests in flight at once, and a token budget per UTC day and
per UTC month. Each gateway process admits a request with one atomic Lua
script in Redis that checks every limit and, only when all hold, counts the
request and reserves an estimate of its tokens; when the answer ends, a
second script settles the reservation to the tokens the engine reported and
releases the concurrency slot. Scripts from concurrent requests are written
together at the end of an event-loop turn on the limiter's own connection
(``_Link``: hiredis packs and parses, answers are handed out as they arrive,
no task per round trip), so a burst costs one round trip; a settle waits up
to ``SETTLE_DELAY`` to ride with the next admission. Nothing about a key
without limits touches Redis.

Windows are fixed UTC minutes, days and months: within a minute at most RPM
requests are admitted, whichever processes admit them. Without Redis (the
embedded default) the same decision runs in the process's memory: exact for
that one process.

If Redis cannot be reached the request is admitted (and logged, and counted
in ``llmgw_gateway_limit_errors_total``): a dead limiter must not take every
team's traffic down with it.
"""

from __future__ import annotations

import asyncio
import calendar
import datetime as dt
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter

from .metrics import METRICS_DIR  # noqa: F401 - prometheus_client's multiprocess mode is set up there

logger = logging.getLogger(__name__)

LIMIT_ERRORS = Counter("llmgw_gateway_limit_errors_total",
                       "Requests admitted without their key's limits because Redis could not be asked.")

# A reason's index in the scripts' answer (0: admitted).
ADMITTED, RPM, TPM, CONCURRENT, DAILY, MONTHLY = range(6)
REASONS = {RPM: "requests per minute", TPM: "tokens per minute", CONCURRENT: "concurrent requests",
           DAILY: "daily token budget", MONTHLY: "monthly token budget"}
# A concurrency slot a crashed process never gave back frees itself after this long.
CONCURRENCY_TTL = 3600
# How long a settle waits to share the next admission's round trip.
SETTLE_DELAY = 0.002
# Seconds for one round trip (or a connect) to Redis before the batch is admitted without limits.
REDIS_TIMEOUT = 2.0

_ADMIT = """
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}
local est = tonumber(ARGV[6])
local adds = {1, est, 1, est, est}
local ttls = {120, 120, tonumber(ARGV[7]), 172800, 2764800}
local used = {0, 0, 0, 0, 0}
for i = 1, 5 do
  if limits[i] > 0 then
    used[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
  end
end
for i = 1, 5 do
  if limits[i] > 0 and used[i] + adds[i] > limits[i] then
    return {i, used[1], used[2], used[3], used[4], used[5]}
  end
end
for i = 1, 5 do
  if limits[i] > 0 then
    used[i] = redis.call('INCRBY', KEYS[i], adds[i])
    redis.call('EXPIRE', KEYS[i], ttls[i])
  end
end
return {0, used[1], used[2], used[3], used[4], used[5]}
"""

# KEYS: tpm window, concurrency, day, month; ARGV: token delta, release (0/1), and which keys are counted.
_SETTLE = """
local delta = tonumber(ARGV[1])
if ARGV[3] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then redis.call('INCRBY', KEYS[1], delta) end
if ARGV[2] == '1' and tonumber(redis.call('GET', KEYS[2]) or '0') > 0 then redis.call('DECR', KEYS[2]) end
if ARGV[4] == '1' and redis.call('EXISTS', KEYS[3]) == 1 then redis.call('INCRBY', KEYS[3], delta) end
if ARGV[5] == '1' and redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCRBY', KEYS[4], delta) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits; None: no such limit."""

    rpm: int | None = None
    tpm: int | None = None
    concurrent: int | None = None
    daily_tokens: int | None = None
    monthly_tokens: int | None = None

    def values(self) -> tuple[int, int, int, int, int]:
        return (self.rpm or 0, self.tpm or 0, self.concurrent or 0, self.daily_tokens or 0, self.monthly_tokens or 0)

    @property
    def tokens(self) -> bool:
        return bool(self.tpm or self.daily_tokens or self.monthly_tokens)


def limits_of(rpm, tpm, concurrent, daily, monthly) -> Limits | None:
    limits = Limits(rpm or None, tpm or None, concurrent or None, daily or None, monthly or None)
    return limits if any(limits.values()) else None


@dataclass(frozen=True, slots=True)
class Windows:
    """The Redis keys of one request's windows, and when each resets (unix seconds)."""

    keys: tuple[str, str, str, str, str]
    minute_ends: float
    day_ends: float
    month_ends: float


_MINUTE: list = [None, None]  # [minute, (day, month, day ends, month ends)]: the calendar, once a minute


def windows(key_id: int, now: float) -> Windows:
    minute = int(now // 60)
    if _MINUTE[0] != minute:
        day = int(now // 86400)
        utc = time.gmtime(now)
        next_month = dt.datetime(utc.tm_year + (utc.tm_mon == 12), utc.tm_mon % 12 + 1, 1, tzinfo=dt.timezone.utc)
        _MINUTE[1] = (day, utc.tm_year * 100 + utc.tm_mon, (day + 1) * 86400.0,
                      float(calendar.timegm(next_month.timetuple())))
        _MINUTE[0] = minute
    day, month, day_ends, month_ends = _MINUTE[1]
    base = f"llmgw:limit:{key_id}:"
    return Windows(
        keys=(f"{base}r:{minute}", f"{base}t:{minute}", f"{base}c", f"{base}d:{day}", f"{base}m:{month}"),
        minute_ends=(minute + 1) * 60.0, day_ends=day_ends, month_ends=month_ends,
    )


@dataclass(slots=True)
class Verdict:
    """What the limiter said of one request: ``reason`` 0 when admitted."""

    reason: int
    used: tuple[int, int, int, int, int]
    limits: Limits
    windows: Windows
    estimate: int
    now: float

    @property
    def admitted(self) -> bool:
        return self.reason == ADMITTED

    def retry_after(self) -> int:
        if self.reason in (RPM, TPM):
            wait = self.windows.minute_ends - self.now
        elif self.reason == DAILY:
            wait = self.windows.day_ends - self.now
        elif self.reason == MONTHLY:
            wait = self.windows.month_ends - self.now
        else:
            wait = 1.0
        return max(1, math.ceil(wait))

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the per-minute limits the key has."""
        limits, headers = self.limits, {}
        reset = _duration(self.windows.minute_ends - self.now)
        if limits.rpm:
            headers["x-ratelimit-limit-requests"] = str(limits.rpm)
            headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - self.used[0]))
            headers["x-ratelimit-reset-requests"] = reset
        if limits.tpm:
            headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - self.used[1]))
            headers["x-ratelimit-reset-tokens"] = reset
        return headers

    def message(self, key_name: str) -> str:
        what = REASONS[self.reason]
        limit = self.limits.values()[self.reason - 1]
        if self.reason == CONCURRENT:
            return (f"Rate limit reached for key {key_name}: {limit} {what} (the key's limit). "
                    f"Retry when one of its requests has finished.")
        if self.reason in (DAILY, MONTHLY):
            return (f"You exceeded your current quota: key {key_name} has used {self.used[self.reason - 1]} of its "
                    f"{what} of {limit} tokens (this request needs about {self.estimate} more). "
                    f"Retry after {self.retry_after()}s, or ask an operator to raise it.")
        used = self.used[self.reason - 1]
        return (f"Rate limit reached for key {key_name} on {what}: limit {limit}, used {used}"
                + (f", requested {self.estimate}" if self.reason == TPM else "")
                + f". Retry after {self.retry_after()}s.")


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``59s``, ``1m0s``, ``250ms``."""
    if seconds < 1:
        return f"{max(0, int(seconds * 1000))}ms"
    whole = int(math.ceil(seconds))
    return f"{whole // 60}m{whole % 60}s" if whole >= 60 else f"{whole}s"


def decide(limits: Limits, used: tuple[int, ...], estimate: int) -> int:
    """The admission rule the Lua script applies, as a pure function: the first limit the request would pass
    (1-5), or 0 when every limit holds."""
    adds = (1, estimate, 1, estimate, estimate)
    for index, (limit, now_used, add) in enumerate(zip(limits.values(), used, adds), start=1):
        if limit and now_used + add > limit:
            return index
    return ADMITTED


class Ticket:
    """An admitted request's reservation, settled once when its answer ends."""

    __slots__ = ("verdict", "settled")

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.settled = False


class RedisLimiter:
    """Admits and settles through Redis: the scripts of one event-loop turn go out in one write on the
    limiter's own connection (``_Link``), and their answers are read as they arrive."""

    def __init__(self, url: str) -> None:
        from redis.connection import parse_url

        self.options = parse_url(url)
        self._link: _Link | None = None
        self._connecting: asyncio.Task | None = None
        self._pending: list[list] = []  # [script, args, future or None]: not yet written
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None

    # --- sending --------------------------------------------------------------------------

    def _send(self, script: "_Script", args: tuple, future: asyncio.Future | None) -> None:
        self._pending.append([script, args, future])
        if future is None:
            # A settle waits a moment for the next admission's write (one round trip for both), or goes
            # alone after SETTLE_DELAY: a concurrency slot comes back at most that much later.
            if self._timer is None and not self._scheduled:
                self._timer = asyncio.get_running_loop().call_later(SETTLE_DELAY, self._flush)
            return
        if not self._scheduled:
            # At the end of this loop turn: this turn's other admissions join the write.
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        link = self._link
        if link is None or link.closed:
            if self._connecting is None or self._connecting.done():
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return  # written once connected (or failed, admitted without limits)
        batch, self._pending = self._pending, []
        link.write(batch)

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        options = self.options
        try:
            async with asyncio.timeout(REDIS_TIMEOUT):
                if "path" in options:
                    _, link = await loop.create_unix_connection(lambda: _Link(loop), options["path"])
                else:
                    from redis.connection import SSLConnection

                    ssl = None
                    if options.get("connection_class") is SSLConnection:  # rediss://
                        import ssl as ssl_module

                        ssl = ssl_module.create_default_context(cafile=options.get("ssl_ca_certs"))
                    _, link = await loop.create_connection(lambda: _Link(loop), options.get("host", "localhost"),
                                                           options.get("port", 6379), ssl=ssl)
                hello = []
                if options.get("password"):
                    auth = (options["username"], options["password"]) if options.get("username") else (
                        options["password"],)
                    hello.append(("AUTH", *auth))
                if options.get("db"):
                    hello.append(("SELECT", options["db"]))
                for command in hello:
                    future = loop.create_future()
                    link.write([[_HELLO, command, future]])
                    answer = await future
                    if isinstance(answer, Exception):
                        raise answer
        except Exception as exc:
            self._fail_pending(exc)
            return
        self._link = link
        self._flush()

    def _fail_pending(self, exc: BaseException) -> None:
        batch, self._pending = self._pending, []
        _failed(batch, exc)

    # --- the limiter ------------------------------------------------------------------------

    async def admit(self, key_id: int, limits: Limits, estimate: int) -> Verdict:
        now = time.time()
        win = windows(key_id, now)
        future = asyncio.get_running_loop().create_future()
        self._send(_ADMIT_SCRIPT, (5, *win.keys, *limits.values(), estimate, CONCURRENCY_TTL), future)
        try:
            answer = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The client went away while Redis answered: give back what the script may have taken.
            future.add_done_callback(lambda f: self._abandoned(f, limits, win, estimate, now))
            raise
        except Exception:
            return Verdict(ADMITTED, (0, 0, 0, 0, 0), limits, win, estimate, now)
        return _verdict(answer, limits, win, estimate, now)

    def _abandoned(self, future: asyncio.Future, limits: Limits, win: Windows, estimate: int, now: float) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        verdict = _verdict(future.result(), limits, win, estimate, now)
        if verdict.admitted:
            self.settle(Ticket(verdict), 0)

    def settle(self, ticket: Ticket, tokens: int) -> None:
        verdict = ticket.verdict
        limits, keys = verdict.limits, verdict.windows.keys
        flags = ("1" if limits.concurrent else "0", "1" if limits.tpm else "0", "1" if limits.daily_tokens else "0",
                 "1" if limits.monthly_tokens else "0")
        self._send(_SETTLE_SCRIPT, (4, keys[1], keys[2], keys[3], keys[4], tokens - verdict.estimate, *flags), None)

    async def close(self) -> None:
        if self._pending:
            self._flush()
        if self._connecting is not None and not self._connecting.done():
            try:
                await self._connecting
            except Exception:
                pass
        link = self._link
        if link is not None:
            await link.drained(REDIS_TIMEOUT)
            link.close()
            self._link = None


class _Script:
    """A Lua script sent by its SHA-1 (EVALSHA), and whole (EVAL) to a Redis that does not know it yet."""

    __slots__ = ("source", "sha")

    def __init__(self, source: str) -> None:
        import hashlib

        self.source, self.sha = source, hashlib.sha1(source.encode()).hexdigest()


_ADMIT_SCRIPT, _SETTLE_SCRIPT = _Script(_ADMIT), _Script(_SETTLE)
_HELLO = "hello"  # an entry of the connection's own (AUTH, SELECT): not a request's


def _failed(entries, exc: BaseException) -> None:
    """Entries that got no answer: an admission goes on without limits (logged and counted); a settle is lost
    (its concurrency slot frees itself after CONCURRENCY_TTL)."""
    futures = [(script, future) for script, _, future in entries if future is not None and not future.done()]
    admissions = sum(1 for script, _ in futures if script is not _HELLO)
    if admissions:
        LIMIT_ERRORS.inc(admissions)
        logger.warning("gateway limits: redis failed (admitting without limits): %s", exc)
    error = ConnectionError(f"redis: {exc}")
    for _, future in futures:
        future.set_exception(error)


class _Link(asyncio.Protocol):
    """The limiter's connection: commands written in batches, answers parsed by hiredis as they arrive and
    handed, in order, to whoever waits for them. No task per round trip, no reader coroutine: redis-py's
    pipeline and parser around the same scripts were most of the limiter's CPU. A connection that does not
    answer within REDIS_TIMEOUT is dropped with everything it carried (admitted without limits)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        import hiredis

        self.loop = loop
        self.reader = hiredis.Reader()
        self.pack = hiredis.pack_command
        self.transport = None
        # [script (a _Script; None: a command whole; _HELLO), args, future or None] in the order written
        self.waiting: deque = deque()
        self.closed = False
        self.progress = 0.0
        self.watchdog: asyncio.TimerHandle | None = None
        self.empty: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def write(self, batch: list) -> None:
        if self.closed:
            _failed(batch, ConnectionError("the connection to Redis closed"))
            return
        pack = self.pack
        chunks = []
        for entry in batch:
            script, args, _ = entry
            chunks.append(pack(("EVALSHA", script.sha, *args)) if isinstance(script, _Script) else pack(args))
        if not self.waiting:
            self.progress = self.loop.time()
        self.waiting.extend(batch)
        self.transport.write(b"".join(chunks))
        if self.watchdog is None:
            self.watchdog = self.loop.call_later(REDIS_TIMEOUT, self._check)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = self.reader.gets()
            except Exception as exc:  # hiredis.ProtocolError: not Redis, or out of step
                self._drop(exc)
                return
            if reply is False:
                break
            if not waiting:
                self._drop(ConnectionError("an answer nobody asked for"))
                return
            script, args, future = waiting.popleft()
            if isinstance(reply, Exception) and isinstance(script, _Script) and str(reply).startswith("NOSCRIPT"):
                # Redis restarted, or its scripts were flushed: once whole (EVAL loads it for the next ones).
                waiting.append([None, ("EVAL", script.source, *args), future])
                self.transport.write(self.pack(("EVAL", script.source, *args)))
                continue
            if future is not None and not future.done():
                future.set_result(reply)
        self.progress = self.loop.time()
        if not waiting and self.empty is not None and not self.empty.done():
            self.empty.set_result(None)

    def _check(self) -> None:
        self.watchdog = None
        if not self.waiting or self.closed:
            return
        late = self.loop.time() - self.progress
        if late >= REDIS_TIMEOUT:
            self._drop(TimeoutError(f"no answer from Redis within {REDIS_TIMEOUT:g}s"))
        else:
            self.watchdog = self.loop.call_later(REDIS_TIMEOUT - late, self._check)

    def _drop(self, exc: BaseException) -> None:
        self.close()
        waiting, self.waiting = list(self.waiting), deque()
        _failed(waiting, exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.cancel()
            self.watchdog = None
        if self.waiting:
            waiting, self.waiting = list(self.waiting), deque()
            _failed(waiting, exc or ConnectionError("Redis closed the connection"))
        if self.empty is not None and not self.empty.done():
            self.empty.set_result(None)

    async def drained(self, timeout: float) -> None:
        """Until every answer written for has arrived (the last settles), at most ``timeout``."""
        if self.waiting and not self.closed:
            self.empty = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self.empty), timeout)
            except TimeoutError:
                pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()


def _verdict(answer, limits: Limits, win: Windows, estimate: int, now: float) -> Verdict:
    return Verdict(int(answer[0]), tuple(int(v) for v in answer[1:6]), limits, win, estimate, now)


class LocalLimiter:
    """The same rule in this process's memory, for a gateway without Redis."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._swept = 0.0

    async def admit(self, key_id: int, limits: Limits, estimate: int) -> Verdict:
        now = time.time()
        if now - self._swept > 60:
            self._sweep(now)
        win = windows(key_id, now)
        values = limits.values()
        used = tuple(self.counts.get(k, 0) if v else 0 for k, v in zip(win.keys, values))
        reason = decide(limits, used, estimate)
        if reason == ADMITTED:
            adds = (1, estimate, 1, estimate, estimate)
            used = tuple(u + a if v else 0 for u, a, v in zip(used, adds, values))
            for k, u, v in zip(win.keys, used, values):
                if v:
                    self.counts[k] = u
        return Verdict(reason, used, limits, win, estimate, now)

    def settle(self, ticket: Ticket, tokens: int) -> None:
        verdict = ticket.verdict
        limits, keys = verdict.limits, verdict.windows.keys
        delta = tokens - verdict.estimate
        for index, on in ((1, limits.tpm), (3, limits.daily_tokens), (4, limits.monthly_tokens)):
            if on and keys[index] in self.counts:
                self.counts[keys[index]] += delta
        if limits.concurrent and self.counts.get(keys[2], 0) > 0:
            self.counts[keys[2]] -= 1

    def _sweep(self, now: float) -> None:
        self._swept = now
        minute, day = int(now // 60), int(now // 86400)
        for name in list(self.counts):
            kind, _, window = name.rpartition(":")
            if kind.endswith(":r") or kind.endswith(":t"):
                if int(window) < minute - 1:
                    del self.counts[name]
            elif kind.endswith(":d") and int(window) < day - 1:
                del self.counts[name]

    async def close(self) -> None:
        return None


def estimate_tokens(body_bytes: int, max_tokens: int | None, default_completion: int) -> int:
    """Tokens reserved at admission: about a token per 4 bytes of body, plus the completion asked for."""
    return body_bytes // 4 + 1 + (max_tokens if max_tokens is not None and max_tokens >= 0 else default_completion)
