from django.apps import AppConfig


class ProvisioningConfig(AppConfig):
    name = "provisioning"

    def ready(self) -> None:
        from core.events import event_kinds_register

        from . import stepkit, vm_steps
        from .choices import ProvisioningEventKind
        from .onboard import request, steps

        event_kinds_register(owner=self.label, kinds=ProvisioningEventKind)

        stepkit.kind_register(kind=vm_steps.KIND, steps=vm_steps.PROVISION_STEPS,
                              on_success=request.onboard_after_provision)
        stepkit.kind_register(kind=steps.KIND, steps=steps.ONBOARD_STEPS)
