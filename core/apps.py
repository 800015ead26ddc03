from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "core"

    def ready(self) -> None:
        # Imported here, not at the top: an AppConfig module is loaded before the models are.
        from .choices import CoreEventKind
        from .events import event_kinds_register

        event_kinds_register(owner=self.label, kinds=CoreEventKind)
