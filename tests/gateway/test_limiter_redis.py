"""The limiter's own Redis connection (gateway/limits.py): Redis away means
admitted without limits (never a refusal, never a hang), and a connection
Redis dropped is replaced on the next round trip, never read out of step."""

from __future__ import annotations

import asyncio

from django.conf import settings

from gateway.limits import LIMIT_ERRORS, Limits, RedisLimiter, Ticket
from tests.conftest import free_port

from .test_limits import clean_limits  # noqa: F401 - a fixture

LIMITS = Limits(rpm=100, concurrent=5)


def test_redis_away_admits_without_limits():
    async def scenario():
        limiter = RedisLimiter(f"redis://127.0.0.1:{free_port()}/0")
        before = LIMIT_ERRORS._value.get()
        verdict = await asyncio.wait_for(limiter.admit(7, LIMITS, 0), 10)
        errors = LIMIT_ERRORS._value.get() - before
        await limiter.close()
        return verdict.admitted, errors

    assert asyncio.run(scenario()) == (True, 1)


def test_a_dropped_connection_is_replaced(clean_limits):  # noqa: F811
    import redis.asyncio as aredis

    async def scenario():
        limiter = RedisLimiter(settings.LLMGW_REDIS_URL)
        first = await limiter.admit(7, LIMITS, 0)
        limiter.settle(Ticket(first), 0)
        await asyncio.sleep(0.05)  # the settle went out alone
        host, port = limiter._link.transport.get_extra_info("sockname")[:2]
        async with aredis.Redis.from_url(settings.LLMGW_REDIS_URL) as other:
            assert await other.client_kill_filter(_id=None, addr=f"{host}:{port}") == 1
        await asyncio.sleep(0.05)
        assert limiter._link.closed  # seen at once, not on the next use
        second = await limiter.admit(7, LIMITS, 0)  # on a new connection: counted
        await limiter.close()
        return first.used[:3], second.used[:3]

    first, second = asyncio.run(scenario())
    assert first == (1, 0, 1)
    assert second == (2, 0, 1)  # the first request's slot came back


def test_an_answer_that_does_not_come_admits_without_limits():
    """A Redis that accepts and never answers: each admission waits REDIS_TIMEOUT at most, then goes on."""

    from gateway import limits

    async def scenario():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        limits.REDIS_TIMEOUT, saved = 0.3, limits.REDIS_TIMEOUT
        try:
            limiter = RedisLimiter(f"redis://127.0.0.1:{port}/0")
            before = LIMIT_ERRORS._value.get()
            started = asyncio.get_running_loop().time()
            verdict = await asyncio.wait_for(limiter.admit(7, LIMITS, 0), 10)
            waited = asyncio.get_running_loop().time() - started
            errors = LIMIT_ERRORS._value.get() - before
            await limiter.close()
        finally:
            limits.REDIS_TIMEOUT = saved
            server.close()
        return verdict.admitted, errors, waited

    admitted, errors, waited = asyncio.run(scenario())
    assert admitted and errors == 1 and 0.25 <= waited < 2


def test_scripts_unknown_to_redis_are_sent_whole(clean_limits):  # noqa: F811
    """After SCRIPT FLUSH (a Redis restarted): the next admission still counts, on the same connection."""
    import redis.asyncio as aredis

    async def scenario():
        limiter = RedisLimiter(settings.LLMGW_REDIS_URL)
        first = await limiter.admit(8, LIMITS, 0)
        async with aredis.Redis.from_url(settings.LLMGW_REDIS_URL) as other:
            await other.script_flush()
        link = limiter._link
        second = await limiter.admit(8, LIMITS, 0)
        same = limiter._link is link
        await limiter.close()
        return first.used[:3], second.used[:3], same

    assert asyncio.run(scenario()) == ((1, 0, 1), (2, 0, 2), True)
