from django.db import models


class CertificateKind(models.TextChoices):
    CA = "ca", "certificate authority"
    SERVER = "server", "server"
    CLIENT = "client", "client (node)"
