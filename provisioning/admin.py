from django import forms
from django.contrib import admin

from .models import Hypervisor, Job, Step
from .vault import secret_encrypt


class HypervisorForm(forms.ModelForm):
    # Write-only: the stored secret is never rendered, not even encrypted.
    token_secret = forms.CharField(
        required=False, widget=forms.PasswordInput(render_value=False),
        help_text="the API token's secret; leave empty to keep the stored one",
    )

    class Meta:
        model = Hypervisor
        exclude = ["token_secret_encrypted"]

    def clean(self):
        data = super().clean()
        if not self.instance.pk and not data.get("token_secret"):
            self.add_error("token_secret", "the API token's secret is required")
        return data

    def save(self, commit=True):
        row = super().save(commit=False)
        if self.cleaned_data.get("token_secret"):
            row.token_secret_encrypted = secret_encrypt(self.cleaned_data["token_secret"])
        if commit:
            row.save()
        return row


@admin.register(Hypervisor)
class HypervisorAdmin(admin.ModelAdmin):
    form = HypervisorForm
    list_display = ["name", "url", "token_id", "node", "storage", "image", "bridge"]
    search_fields = ["name", "url"]


class StepInline(admin.TabularInline):
    model = Step
    extra = 0
    can_delete = False
    fields = ["index", "title", "status", "started_at", "finished_at", "log"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-only: jobs are started, retried and cancelled with 'llmgw ctl' or the API."""

    list_display = ["id", "kind", "node_name", "hypervisor", "status", "created_at", "finished_at"]
    list_filter = ["kind", "status"]
    search_fields = ["node_name"]
    inlines = [StepInline]
    exclude = ["lease_owner", "lease_until", "wake", "marker"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
