"""Pub/sub channels name their Redis database: two deployments (or test runs)
sharing one Redis server do not wake each other's long-polls."""

from __future__ import annotations

import time

from django.conf import settings

from nodes import longpoll
from nodes.liveness import RedisLiveness, channel_nodes, channel_scoped


def _other_db(url: str) -> str:
    base, _, db = url.rpartition("/")
    return f"{base}/{(int(db or 0) + 1) % 16}"


def _messages(pubsub, seconds: float) -> list[bytes]:
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        message = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.1)
        if message:
            got.append(message["data"])
    return got


def test_a_change_in_one_database_wakes_only_that_databases_watchers():
    ours, theirs = RedisLiveness(settings.LLMGW_REDIS_URL), RedisLiveness(_other_db(settings.LLMGW_REDIS_URL))
    assert channel_scoped(ours.client, longpoll.CHANNEL) != channel_scoped(theirs.client, longpoll.CHANNEL)
    listening = ours.client.pubsub()
    listening.subscribe(channel_scoped(ours.client, longpoll.CHANNEL))
    _messages(listening, 0.2)
    try:
        theirs.bump_many(["chan-node01"], channel=longpoll.CHANNEL)
        assert _messages(listening, 0.5) == []
        ours.bump_many(["chan-node01"], channel=longpoll.CHANNEL)
        assert _messages(listening, 2.0) == [b"chan-node01"]
        ours.bump_many(["chan-node01", "chan-node02"], channel=longpoll.CHANNEL)  # one message names them all
        assert [channel_nodes(m) for m in _messages(listening, 2.0)] == [["chan-node01", "chan-node02"]]
    finally:
        listening.close()
        for store in (ours, theirs):
            store.client.hdel("llmgw:nodes:generation", "chan-node01")
