# The wave's branches each added a 0005 of their own, independent of one another.
from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("replicas", "0005_route20_catalogentry_routing"),
        ("replicas", "0005_scale21_autoscale"),
        ("replicas", "0005_churn27_failed_quiesced"),
        ("replicas", "0005_roll26_revisions_rollouts"),
    ]
    operations = []
