from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "provisioning"

    def ready(self) -> None:
        from core.events import event_kinds_register

        from . import onboard_finish, onboarding, stepkit, steps
        from .choices import ProvisioningEventKind

        event_kinds_register(owner=self.label, kinds=ProvisioningEventKind)

        stepkit.kind_register(kind=steps.KIND, steps=steps.PROVISION_STEPS,
                              on_success=onboarding.onboard_after_provision)
        stepkit.kind_register(kind=onboard_finish.KIND, steps=onboard_finish.ONBOARD_STEPS)
