"""Each autoscaled model's recent samples: what the decision looks back on
(its windows) and what the model's page draws (the last hour). Telemetry,
not state: a bounded Redis list per model (a bounded file on the embedded
default, which has no Redis), never a database row per reading."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import redis
from django.conf import settings

logger = logging.getLogger(__name__)

KEY = "llmgw:autoscale:history:{}"
DECISIONS_KEY = "llmgw:autoscale:decisions"
KEEP_SECONDS = 3600.0
# Bounded whatever the interval: an hour at 2 s, with room.
KEEP_MAX = 4000


def _trimmed(samples: list[dict], now: float) -> list[dict]:
    return [s for s in samples if s.get("at", 0) >= now - KEEP_SECONDS][-KEEP_MAX:]


class RedisHistory:
    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)

    def append(self, model: str, sample: dict) -> None:
        key = KEY.format(model)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(key, json.dumps(sample))
        pipe.ltrim(key, -KEEP_MAX, -1)
        pipe.expire(key, int(KEEP_SECONDS * 2))
        pipe.execute()

    def read(self, model: str, *, since: float, limit: int = KEEP_MAX) -> list[dict]:
        raw = self.client.lrange(KEY.format(model), -limit, -1)
        out = []
        for item in raw:
            try:
                sample = json.loads(item)
            except ValueError:
                continue
            if sample.get("at", 0) >= since:
                out.append(sample)
        return out

    def count_decision(self, model: str, rule: str) -> None:
        self.client.hincrby(DECISIONS_KEY, f"{model}\t{rule}", 1)

    def decisions(self) -> dict[tuple[str, str], int]:
        out = {}
        for field, value in self.client.hgetall(DECISIONS_KEY).items():
            model, _, rule = field.decode().partition("\t")
            out[(model, rule)] = int(value)
        return out


class FileHistory:
    """One JSON file per model under the data directory (one host)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, model: str) -> Path:
        return self.directory / f"{model}.json"

    def _load(self, path: Path) -> list | dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return []

    def _store(self, path: Path, value) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(value, handle)
        os.replace(tmp, path)

    def append(self, model: str, sample: dict) -> None:
        path = self._path(model)
        self._store(path, _trimmed([*self._load(path), sample], time.time()))

    def read(self, model: str, *, since: float, limit: int = KEEP_MAX) -> list[dict]:
        return [s for s in self._load(self._path(model))[-limit:] if s.get("at", 0) >= since]

    def count_decision(self, model: str, rule: str) -> None:
        path = self.directory / "_decisions.json"
        counts = self._load(path) or {}
        counts[f"{model}\t{rule}"] = counts.get(f"{model}\t{rule}", 0) + 1
        self._store(path, counts)

    def decisions(self) -> dict[tuple[str, str], int]:
        counts = self._load(self.directory / "_decisions.json") or {}
        return {tuple(k.split("\t", 1)): v for k, v in counts.items()}


@lru_cache(maxsize=1)
def store() -> RedisHistory | FileHistory:
    if settings.LLMGW_REDIS_URL:
        return RedisHistory(settings.LLMGW_REDIS_URL)
    return FileHistory(Path(settings.DATA_DIR) / "autoscale")
