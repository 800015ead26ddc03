"""Event, taken over from nodes (``nodes/0007_event_moves_to_core``) in the
migration state only: the table keeps its name ``nodes_event`` and its rows.
``kind`` carries no choices: each app registers the kinds it records
(``core.events``), so a new kind needs no migration of core.

The content type follows the model (``nodes.event`` becomes ``core.event``),
so that the roles' permissions (``view_event``) and the admin's history of
events stay attached to it."""

import django.db.models.deletion
from django.db import migrations, models


def content_type_move(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if ContentType.objects.filter(app_label="core", model="event").exists():
        return
    ContentType.objects.filter(app_label="nodes", model="event").update(app_label="core")


def content_type_back(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if ContentType.objects.filter(app_label="nodes", model="event").exists():
        return
    ContentType.objects.filter(app_label="core", model="event").update(app_label="nodes")


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("nodes", "0007_event_moves_to_core"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Event",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                        ("kind", models.CharField(max_length=32)),
                        ("severity", models.CharField(choices=[("info", "Info"), ("warning", "Warning"), ("error", "Error")], default="info", max_length=8)),
                        ("subject", models.CharField(help_text="what it is about: node/node01, replica/12", max_length=128)),
                        ("message", models.TextField()),
                        ("data", models.JSONField(blank=True, default=dict)),
                        ("node", models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="events", to="nodes.node")),
                    ],
                    options={
                        "ordering": ["-created_at", "-id"],
                        "db_table": "nodes_event",
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(content_type_move, content_type_back),
    ]
