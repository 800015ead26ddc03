"""Event moves to core (the app below every other): out of nodes' state only.
The table ``nodes_event`` and its rows stay where they are; core's
``0001_event_from_nodes`` takes the model over with ``db_table="nodes_event"``."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0006_gpu_missing_and_conflicts"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="Event")],
            database_operations=[],
        ),
    ]
