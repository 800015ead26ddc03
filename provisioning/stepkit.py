"""What a job kind is made of: an ordered list of steps, each a function that
looks at the world, does what is missing, and says how it went.

A step function takes a StepContext and returns Done, Skipped (found already
done) or Wait (not finished: run me again in a while, without holding a
worker slot); it raises StepFailed when it cannot succeed. Every step is run
again from its start after a worker dies, so each must first look and skip
what is done. Onboarding registers its own kind the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from django.utils import timezone

from .models import Step


@dataclass(frozen=True)
class Done:
    note: str = ""


@dataclass(frozen=True)
class Skipped:
    note: str


@dataclass(frozen=True)
class Wait:
    seconds: float
    note: str = ""


Outcome = Done | Skipped | Wait


@dataclass
class StepContext:
    job: Any
    step: Any
    data: dict[str, Any]
    lines: list[dict[str, str]] = field(default_factory=list)

    def log(self, line: str) -> None:
        self.lines.append({"at": timezone.now().isoformat(timespec="seconds"), "line": line})

    def deadline(self, key: str, seconds: float) -> float:
        """Seconds left before the deadline this step set itself the first time it asked."""
        if key not in self.data:
            self.data[key] = time.time() + seconds
        return self.data[key] - time.time()

    def backoff(self, key: str, *, start: float, ceiling: float) -> float:
        """The next poll interval: doubling from start up to ceiling."""
        current = float(self.data.get(key, start / 2))
        nxt = min(max(current * 2, start), ceiling)
        self.data[key] = nxt
        return nxt


@dataclass(frozen=True)
class StepSpec:
    name: str
    title: str
    run: Callable[[StepContext], Outcome]


_KINDS: dict[str, list[StepSpec]] = {}
_FOLLOWUPS: dict[str, Callable[[Any], None]] = {}


def kind_register(*, kind: str, steps: list[StepSpec], on_success: Callable[[Any], None] | None = None) -> None:
    """on_success(job) runs once the job has succeeded (provisioning chains onboarding so)."""
    _KINDS[kind] = list(steps)
    if on_success is not None:
        _FOLLOWUPS[kind] = on_success


def kind_followup(job) -> None:
    followup = _FOLLOWUPS.get(job.kind)
    if followup is not None:
        followup(job)


def kind_steps(kind: str) -> list[StepSpec]:
    return _KINDS[kind]


def job_steps_create(job) -> None:
    """The rows of a new job's steps, in its kind's order (provisioning and onboarding alike)."""
    Step.objects.bulk_create(
        Step(job=job, index=i, name=spec.name, title=spec.title) for i, spec in enumerate(kind_steps(job.kind))
    )
