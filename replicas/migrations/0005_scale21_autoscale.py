from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("replicas", "0004_catalogentry_trust_engine_code"),
    ]

    operations = [
        migrations.AddField(
            model_name="catalogentry",
            name="autoscale",
            field=models.JSONField(blank=True, default=None, null=True),
        ),
        migrations.AddField(
            model_name="catalogentry",
            name="autoscaled_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
