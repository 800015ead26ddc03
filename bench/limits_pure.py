"""The limiter alone: gateway-side CPU per request of admitting and settling through Redis.

    python bench/limits_pure.py [--redis redis://127.0.0.1:6379/4] [--requests 20000]

One process, no web server: ``RedisLimiter.admit`` then ``settle`` for a key
with every limit set, at concurrency 1 (one script per round trip) and 32
(scripts of one loop turn share a pipeline), and the in-memory limiter of the
embedded default. CPU is this process's (time.process_time), per request.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")


async def run(limiter, requests: int, concurrency: int) -> tuple[float, float]:
    from gateway.limits import Limits, Ticket

    limits = Limits(rpm=10 ** 9, tpm=10 ** 9, concurrent=10 ** 6, daily_tokens=10 ** 12, monthly_tokens=10 ** 12)
    left = requests

    async def worker(key_id: int) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            verdict = await limiter.admit(key_id, limits, 300)
            assert verdict.admitted
            limiter.settle(Ticket(verdict), 250)

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(1 + i % 4) for i in range(concurrency)))
    await asyncio.sleep(0.05)  # the last settles' pipeline
    return (time.process_time() - cpu) / requests * 1000, requests / (time.perf_counter() - wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/5")
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    import django

    django.setup()
    from gateway.limits import LocalLimiter, RedisLimiter

    print("limiter alone (this process's CPU per admitted and settled request; a shared 2-core machine)")
    for concurrency in (1, 32):
        async def redis_run():
            limiter = RedisLimiter(args.redis)
            await run(limiter, 500, concurrency)  # warm: scripts loaded, connections open
            result = await run(limiter, args.requests, concurrency)
            await limiter.close()
            import redis.asyncio as aredis

            async with aredis.Redis.from_url(args.redis) as client:  # the run's counters, gone
                keys = [k async for k in client.scan_iter("llmgw:limit:*")]
                if keys:
                    await client.delete(*keys)
            return result

        ms, rate = asyncio.run(redis_run())
        print(f"  Redis, concurrency {concurrency:2d}: {ms:.3f} ms CPU/request, {rate:,.0f} requests/s")
    ms, rate = asyncio.run(run(LocalLimiter(), args.requests, 32))
    print(f"  in memory (no Redis), concurrency 32: {ms:.4f} ms CPU/request, {rate:,.0f} requests/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
