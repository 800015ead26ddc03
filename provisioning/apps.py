from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "provisioning"

    def ready(self) -> None:
        from . import stepkit, steps

        stepkit.kind_register(kind=steps.KIND, steps=steps.PROVISION_STEPS)
