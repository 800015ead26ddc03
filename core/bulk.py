"""Many rows in one statement, as the database does it fastest.

On PostgreSQL a batch goes in with ``COPY ... FROM STDIN``: psycopg streams
the rows in its C text format, where Django's ``bulk_create`` builds an
``INSERT ... UNNEST`` whose arrays (JSON escaped by a regular expression per
value) are quoted in Python. Constraints, defaults the caller gave and the
deferred foreign-key checks at commit are the same either way; elsewhere
(the embedded SQLite default) the rows go through ``bulk_create``.

Rows are plain dicts of attribute names (``node_id``, not ``node``) to
Python values; a field a row leaves out takes its model default, and an
``auto_now_add`` field the time of the insert. Nothing here runs ``save()``
or signals (bulk_create does not either).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from django.db import connection, models
from django.utils import timezone


def _columns(model: type[models.Model], with_pk: bool) -> list[models.Field]:
    return [f for f in model._meta.concrete_fields if with_pk or not f.primary_key]


def _value(field: models.Field, row: dict[str, Any]) -> Any:
    if field.attname in row:
        value = row[field.attname]
    elif getattr(field, "auto_now_add", False) or getattr(field, "auto_now", False):
        value = timezone.now()
    else:
        value = field.get_default()
    if isinstance(field, models.JSONField):
        # COPY's text form of jsonb is its JSON text (as JSONField dumps it).
        return json.dumps(value, cls=field.encoder)
    return value


def _copy(model: type[models.Model], fields: list[models.Field], rows: Sequence[dict[str, Any]]) -> None:
    q = connection.ops.quote_name
    sql = f"COPY {q(model._meta.db_table)} ({', '.join(q(f.column) for f in fields)}) FROM STDIN"
    # The raw cursor's copy() is outside Django's error translation: a unique
    # violation must still be django.db.IntegrityError to the caller.
    with connection.cursor() as cursor, connection.wrap_database_errors, cursor.cursor.copy(sql) as copy:
        for row in rows:
            copy.write_row([_value(f, row) for f in fields])


def rows_insert(model: type[models.Model], rows: Sequence[dict[str, Any]]) -> None:
    """Insert ``rows`` whose ids nobody needs back (allocations, Events)."""
    if not rows:
        return
    if connection.vendor == "postgresql":
        _copy(model, _columns(model, with_pk=False), rows)
    else:
        model.objects.bulk_create([model(**row) for row in rows], batch_size=500)


def rows_insert_returning(model: type[models.Model], rows: Sequence[dict[str, Any]]) -> list[int]:
    """Insert ``rows`` and return their new ids, in order. On PostgreSQL the
    ids are drawn from the table's sequence first (one statement), then the
    rows are copied with them."""
    if not rows:
        return []
    if connection.vendor != "postgresql":
        objs = [model(**row) for row in rows]
        model.objects.bulk_create(objs, batch_size=500)
        return [o.pk for o in objs]
    pk = model._meta.pk
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT nextval(pg_get_serial_sequence(%s, %s)) FROM generate_series(1, %s)",
            [model._meta.db_table, pk.column, len(rows)],
        )
        ids = [i for (i,) in cursor.fetchall()]
    _copy(model, _columns(model, with_pk=True), [{**row, pk.attname: i} for row, i in zip(rows, ids)])
    return ids
