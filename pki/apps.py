from django.apps import AppConfig


class PkiConfig(AppConfig):
    name = "pki"
    verbose_name = "Certificate authority"
