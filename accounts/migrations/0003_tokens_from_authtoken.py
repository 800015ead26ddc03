"""Operator tokens made before accounts.OperatorToken (DRF's authtoken, kept
in clear in ``authtoken_token``) become hashed tokens that still work; the
clear table is dropped. A database that never had it is left as it is."""

import hashlib

from django.db import migrations

LEGACY_TABLE = "authtoken_token"


def tokens_from_authtoken(apps, schema_editor):
    connection = schema_editor.connection
    if LEGACY_TABLE not in connection.introspection.table_names():
        return
    OperatorToken = apps.get_model("accounts", "OperatorToken")
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT key, user_id, created FROM {LEGACY_TABLE}")
        rows = cursor.fetchall()
    for key, user_id, created in rows:
        row = OperatorToken.objects.create(user_id=user_id, name="from authtoken", prefix=key[:8],
                                           secret_hash=hashlib.sha256(key.encode()).hexdigest())
        OperatorToken.objects.filter(pk=row.pk).update(created_at=created)
    schema_editor.execute(f"DROP TABLE {LEGACY_TABLE}")


class Migration(migrations.Migration):
    dependencies = [("accounts", "0002_roles")]

    operations = [migrations.RunPython(tokens_from_authtoken, migrations.RunPython.noop)]
