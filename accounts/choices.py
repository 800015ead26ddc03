from django.db import models


class AccountEventKind(models.TextChoices):
    # Users, roles, superuser grants and operator tokens: who did what to whom.
    ACCOUNT = "account"
