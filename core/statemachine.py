"""The one enforcement point of every state machine: nodes, replicas, drains.

A machine is a status field, its table of allowed transitions (data, in
``<app>/choices.py``) and what its Events say. Every status change goes
through ``StateMachine.transition`` (locks the row itself), ``apply`` (a row
the caller has locked, as a drain's step does) or ``apply_many`` (a batch of
locked rows, as a batch of placements is): each checks the table, sets
``status`` and ``status_changed_at`` (and ``status_reason`` where the model
has one), writes one Event per row, and raises the machine's
``InvalidTransition`` otherwise, having changed nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from typing import Any

from django.db import connection, models, transaction
from django.utils import timezone

from .choices import EventSeverity
from .events import event_record, events_record
from .exceptions import InvalidTransition


class StateMachine:
    """Subclass per model: set the class attributes, and say what its Events
    say (``subject``, ``message``, ``data``, ``event_node``); ``changing`` sets
    fields that go with a change, ``changed`` runs what follows it inside the
    same transaction."""

    noun: str  # "node", "replica", "drain": how refusals name the row
    table: Mapping[str, Set[str]]
    error: type[InvalidTransition] = InvalidTransition
    event_kind: str  # registered by the machine's app (core.events)
    # The model's free-text reason field and its length (None: unbounded), or no field.
    reason_field: str | None = "status_reason"
    reason_max: int | None = None

    # --- what a subclass says -------------------------------------------------------------

    def subject(self, row: Any) -> str:
        raise NotImplementedError

    def message(self, row: Any, previous: str, to: str, reason: str) -> str:
        return f"{previous} -> {to}" + (f": {reason}" if reason else "")

    def data(self, row: Any, previous: str, to: str) -> dict[str, Any]:
        return {"from": previous, "to": to}

    def event_node(self, row: Any) -> Any:
        """The nodes.Node the row's Events are about, if any."""
        return None

    def changing(self, row: Any, previous: str, to: str) -> list[str]:
        """Set the fields that change with this status; return their names."""
        return []

    def changed(self, row: Any, previous: str, to: str) -> None:
        """What follows the change, inside its transaction."""

    # --- the rules ------------------------------------------------------------------------

    def check(self, row: Any, to: str) -> None:
        if to not in self.table.get(row.status, ()):
            raise self.error(f"{self.noun} {row} is {row.status}; it cannot become {to}")

    def _set(self, row: Any, to: str, reason: str, now) -> tuple[str, list[str]]:
        previous = row.status
        row.status = to
        row.status_changed_at = now
        fields = ["status", "status_changed_at"]
        if self.reason_field is not None:
            setattr(row, self.reason_field, reason[: self.reason_max] if self.reason_max else reason)
            fields.append(self.reason_field)
        return previous, fields + self.changing(row, previous, to)

    def _event(self, row: Any, previous: str, to: str, reason: str, severity: str) -> dict[str, Any]:
        return {
            "kind": self.event_kind,
            "subject": self.subject(row),
            "message": self.message(row, previous, to, reason),
            "node": self.event_node(row),
            "severity": severity,
            "data": self.data(row, previous, to),
        }

    def apply(self, row: Any, *, to: str, reason: str = "", severity: str = EventSeverity.INFO) -> str:
        """Change a row the caller holds locked; return its previous status."""
        self.check(row, to)
        previous, fields = self._set(row, to, reason, timezone.now())
        row.save(update_fields=fields)
        event_record(**self._event(row, previous, to, reason, severity))
        self.changed(row, previous, to)
        return previous

    def apply_many(self, rows: list[Any], *, to: str, reasons: Mapping[int, str], also: Iterable[str] = ()) -> None:
        """``apply`` for a batch of rows the caller holds locked, in a few
        statements: every row is checked before any is changed. ``also`` names
        fields the caller set on the rows that are written with them."""
        for row in rows:
            self.check(row, to)
        if not rows:
            return
        now = timezone.now()
        events = []
        fields: list[str] = []
        previous_of = {}
        for row in rows:
            reason = reasons[row.pk]
            previous_of[row.pk], fields = self._set(row, to, reason, now)
            events.append(self._event(row, previous_of[row.pk], to, reason, EventSeverity.INFO))
        meta = type(rows[0])._meta
        columns = [meta.get_field(name) for name in dict.fromkeys([*fields, *also])]
        _rows_update(meta, columns, [
            [c.get_db_prep_save(getattr(row, c.attname), connection) for c in columns] + [row.pk] for row in rows
        ])
        events_record(events)
        for row in rows:
            self.changed(row, previous_of[row.pk], to)

    def transition(
        self,
        rows: models.QuerySet,
        *,
        to: str,
        reason: str = "",
        expected: str | Set[str] | None = None,
        severity: str = EventSeverity.INFO,
        missing: Exception | None = None,
    ) -> Any | None:
        """Lock the one row of ``rows`` and change it.

        With ``expected`` (a status or a set of them) a compare-and-set: if the
        row is no longer in it, nothing happens and None is returned. A row that
        does not exist raises ``missing``, or returns None without it.
        """
        with transaction.atomic():
            # Only this row (not the rows select_related joins in), and
            # FOR NO KEY UPDATE: inserts referencing it (Events, members)
            # need not wait for it. The lock order is in docs/architecture.md.
            row = rows.select_for_update(of=("self",), no_key=True).first()
            if row is None:
                if missing is not None:
                    raise missing
                return None
            if expected is not None:
                allowed = {expected} if isinstance(expected, str) else expected
                if row.status not in allowed:
                    return None
            self.apply(row, to=to, reason=reason, severity=severity)
        return row


def _rows_update(meta, columns: list[models.Field], values: list[list[Any]]) -> None:
    """Write each row's ``values`` (its columns', then its pk) in one
    statement: on PostgreSQL an UPDATE from a VALUES list (one statement for
    the batch; a statement per row, even pipelined, cost the server a
    statement each), elsewhere one statement run per row."""
    q = connection.ops.quote_name
    table, pk = q(meta.db_table), meta.pk
    with connection.cursor() as cursor:
        if connection.vendor != "postgresql":
            cursor.executemany(
                f"UPDATE {table} SET {', '.join(f'{q(c.column)} = %s' for c in columns)} WHERE {q(pk.column)} = %s",
                values,
            )
            return
        names = ", ".join(q(c.column) for c in [*columns, pk])
        # Each column cast to its type: a VALUES column of NULLs alone is text.
        assign = ", ".join(f"{q(c.column)} = v.{q(c.column)}::{c.cast_db_type(connection)}" for c in columns)
        for start in range(0, len(values), 1000):
            chunk = values[start:start + 1000]
            row = "(" + ", ".join(["%s"] * (len(columns) + 1)) + ")"
            cursor.execute(
                f"UPDATE {table} SET {assign} FROM (VALUES {', '.join([row] * len(chunk))}) AS v({names}) "
                f"WHERE {table}.{q(pk.column)} = v.{q(pk.column)}::{pk.cast_db_type(connection)}",
                [value for row_values in chunk for value in row_values],
            )
