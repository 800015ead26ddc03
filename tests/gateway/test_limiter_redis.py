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
        conn = limiter._conn
        await conn.send_command("CLIENT", "ID")
        own_id = await conn.read_response()
        async with aredis.Redis.from_url(settings.LLMGW_REDIS_URL) as other:
            assert await other.client_kill_filter(_id=own_id) == 1
        second = await limiter.admit(7, LIMITS, 0)  # on the dead connection: admitted without limits
        third = await limiter.admit(7, LIMITS, 0)  # on a new one: counted again
        await limiter.close()
        return first.used[:3], second.used[:3], third.used[:3]

    first, second, third = asyncio.run(scenario())
    assert first == (1, 0, 1)
    assert second == (0, 0, 0)  # not counted: Redis was not asked
    assert third == (2, 0, 1)  # the first request's slot came back, the second was never taken
