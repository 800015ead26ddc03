"""Prompt prefixes as chained block hashes, and the gateway's approximate
memory of which replica holds which prefix blocks in its KV cache.

Pure Python, no Django: the body-parsing processes import it too.

A prompt's text is cut into blocks of ``block_chars`` characters (of its
UTF-8 form); block ``i``'s hash is the CRC-32 of everything up to the end of
that block (a running CRC, so the chain costs one pass over the text), tagged
with ``i``. Two prompts share their first ``n`` block hashes exactly when
they share their first ``n x block_chars`` bytes (up to CRC collisions, which
cost a wrong guess, never a wrong answer: the engine decides what it has).
CRC-32 rather than Python's ``hash``: the parsing processes and the web
process must agree, and ``hash`` of a string differs between processes.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any, Iterable

# Defaults; settings override them (docs/gateway.md#routing-policies).
BLOCK_CHARS = 512
MAX_BLOCKS = 128


def prompt_text(body: dict[str, Any]) -> str | None:
    """The text an engine would prefill, near enough: the chat messages'
    roles and contents in order, or the completion prompt. None when the
    body has neither in a form this understands (it is then routed by load)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            role, content = message.get("role"), message.get("content")
            parts.append(role if isinstance(role, str) else "")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):  # [{type: text, text: ...}, ...]
                parts.extend(p["text"] for p in content
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return " ".join(map(str, prompt))  # token ids
    return None


def prompt_blocks(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The chained hashes of the text's first whole blocks (at most ``max_blocks``)."""
    data = memoryview(text.encode())
    count = min(len(data) // block_chars, max_blocks)
    crc = 0
    blocks = []
    append = blocks.append
    for index in range(count):
        start = index * block_chars
        crc = zlib.crc32(data[start:start + block_chars], crc)
        append(crc | (index << 32))
    return tuple(blocks)


def session_weight(session: int, replica_id: int) -> int:
    """Rendezvous (highest random weight) hashing: each (session, replica)
    pair gets a pseudo-random weight; a session lives on its heaviest ready
    replica, so a replica joining or leaving moves only the sessions whose
    heaviest it is or was. (splitmix64's finaliser over the pair.)"""
    z = (session ^ (replica_id * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def session_hash(key: str) -> int:
    data = key.encode()
    return zlib.crc32(data) | (zlib.adler32(data) << 32)


class PrefixMemory:
    """What the gateway sent to each replica of one model, as the engines'
    caches would hold it: per replica an LRU of block hashes bounded by that
    replica's cache (in blocks of this memory), and an index from block hash
    to the replicas holding it.

    A prompt's blocks are touched last block first, so its first block is
    the most recent and a tail goes before its head, as vLLM evicts."""

    __slots__ = ("where", "held")

    def __init__(self) -> None:
        self.where: dict[int, set[int]] = {}
        self.held: dict[int, OrderedDict[int, None]] = {}

    def matches(self, blocks: tuple[int, ...], replica_ids: Iterable[int]) -> dict[int, int]:
        """How many leading blocks of the prompt each replica holds (0 absent).

        A replica holding block ``i`` normally holds every block before it
        (the chain, and the eviction order above), so each replica's match
        is found by bisection: a few lookups per replica, whatever the length."""
        where = self.where
        if not blocks or blocks[0] not in where:
            return {}
        found: dict[int, int] = {}
        for replica_id in replica_ids:
            holders = where.get(blocks[0])
            if holders is None or replica_id not in holders:
                continue
            low, high = 1, len(blocks)  # held: [0, low); unknown: [low, high)
            while low < high:
                middle = (low + high) // 2
                holders = where.get(blocks[middle])
                if holders is not None and replica_id in holders:
                    low = middle + 1
                else:
                    high = middle
            found[replica_id] = low
        return found

    def record(self, replica_id: int, blocks: tuple[int, ...], capacity: int) -> None:
        """The prompt's blocks went to ``replica_id``, whose cache holds about ``capacity`` blocks."""
        if not blocks or capacity <= 0:
            return
        lru = self.held.get(replica_id)
        if lru is None:
            lru = self.held[replica_id] = OrderedDict()
        where = self.where
        move = lru.move_to_end
        for block in reversed(blocks):
            if block in lru:
                move(block)
            else:
                lru[block] = None
                holders = where.get(block)
                if holders is None:
                    where[block] = {replica_id}
                else:
                    holders.add(replica_id)
        while len(lru) > capacity:
            self._drop(replica_id, lru.popitem(last=False)[0])

    def forget(self, replica_id: int) -> None:
        """The replica left (or restarted): its cache is gone."""
        lru = self.held.pop(replica_id, None)
        for block in lru or ():
            self._drop(replica_id, block)

    def replicas(self) -> list[int]:
        return list(self.held)

    def size(self, replica_id: int) -> int:
        lru = self.held.get(replica_id)
        return len(lru) if lru else 0

    def _drop(self, replica_id: int, block: int) -> None:
        holders = self.where.get(block)
        if holders is not None:
            holders.discard(replica_id)
            if not holders:
                del self.where[block]
