from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError

from core.admin import SystemOwnedAdmin
from replicas.models import CatalogEntry

from .models import ApiKey, GatewayProcess
from .services import key_create, key_revoke


class ApiKeyAddForm(forms.ModelForm):
    models_text = forms.CharField(
        label="Models", required=False, help_text="comma-separated model names this key may use; empty: every model"
    )

    class Meta:
        model = ApiKey
        fields = ["name"]

    def clean(self):
        cleaned = super().clean()
        names = {m.strip() for m in cleaned.get("models_text", "").split(",") if m.strip()}
        unknown = names - set(CatalogEntry.objects.filter(name__in=names).values_list("name", flat=True))
        if unknown:
            raise ValidationError(f"no such model in the catalog: {', '.join(sorted(unknown))}")
        return cleaned


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are created and revoked through the services, like 'llmgw ctl keys'."""

    list_display = ("name", "prefix", "models_display", "revoked_at", "requests", "prompt_tokens",
                    "completion_tokens", "last_used_at")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("name", "prefix")
    readonly_fields = ["name", "prefix", "allowed_models", "created_at", "revoked_at", "requests", "prompt_tokens",
                       "completion_tokens", "last_used_at"]
    exclude = ["secret_hash", "updated_at"]
    actions = ["revoke"]

    @admin.display(description="models")
    def models_display(self, obj: ApiKey) -> str:
        return ", ".join(obj.allowed_models) or "all"

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = ApiKeyAddForm
            kwargs["fields"] = ["name"]
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        return ["name", "models_text"] if obj is None else self.readonly_fields

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.readonly_fields

    def save_model(self, request, obj, form, change):
        if change:
            return
        models = [m for m in form.cleaned_data.get("models_text", "").split(",") if m.strip()]
        try:
            created = key_create(name=obj.name, models=models)
        except ValidationError as exc:
            messages.error(request, f"not created: {'; '.join(exc.messages)}")
            return
        obj.pk = created.row.pk
        messages.warning(request, f"API key {created.row.name}: {created.key}  (shown once: copy it now)")

    def has_delete_permission(self, request, obj=None):
        return False  # revoke instead: the row keeps the key's usage

    @admin.action(description="Revoke the selected keys", permissions=["change"])
    def revoke(self, request, queryset):
        for key in queryset:
            key_revoke(name=key.name)
        messages.info(request, f"revoked {queryset.count()} key(s)")


@admin.register(GatewayProcess)
class GatewayProcessAdmin(SystemOwnedAdmin):
    list_display = ("name", "seen_at", "routes", "inflight")
