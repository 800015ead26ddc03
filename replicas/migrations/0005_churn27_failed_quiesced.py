"""A failed replica's live members are now wanted until it is quiesced (they
finish their in-flight requests, issue 27): replicas that failed before hold
nothing that should start again."""

from django.db import migrations


def failed_quiesced(apps, schema_editor):
    apps.get_model("replicas", "Replica").objects.filter(status="failed").update(quiesced=True)


class Migration(migrations.Migration):
    dependencies = [("replicas", "0004_catalogentry_trust_engine_code")]
    operations = [migrations.RunPython(failed_quiesced, migrations.RunPython.noop)]
