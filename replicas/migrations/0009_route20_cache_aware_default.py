from django.db import migrations, models


class Migration(migrations.Migration):
    """New catalog entries route cache-aware unless they say otherwise
    (issue 20: bench/routing.py and bench/routing_sim.py, docs/benchmarks.md#routing).
    Entries already there keep the policy they have."""

    dependencies = [
        ('replicas', '0008_roll26_rollout_weights'),
    ]

    operations = [
        migrations.AlterField(
            model_name='catalogentry',
            name='routing',
            field=models.CharField(choices=[('least-outstanding', 'Least Outstanding'), ('cache-aware', 'Cache Aware'), ('session', 'Session')], default='cache-aware', max_length=32),
        ),
    ]
