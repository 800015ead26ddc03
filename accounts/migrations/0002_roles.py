"""The three role groups (viewer, operator, admin) with the permissions of
accounts/roles.py. Django creates permissions after the last migration; they
are created here first so that the groups can hold them. (After every
migrate, accounts' post_migrate hook brings the groups up to date again.)"""

from django.contrib.auth.management import create_permissions
from django.db import migrations

from accounts.roles import roles_sync


def forwards(apps, schema_editor):
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    roles_sync(group_model=apps.get_model("auth", "Group"), permission_model=apps.get_model("auth", "Permission"))


def backwards(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name__in=["viewer", "operator", "admin"]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0001_initial"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("nodes", "0004_event_kind_provisioning"),
        ("replicas", "0002_catalogentry_drain_status_changed_at"),
        ("pki", "0001_initial"),
        ("gateway", "0001_initial"),
        ("provisioning", "0001_initial"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
