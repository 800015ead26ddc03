"""The UI's catalog page refuses unknown keys as 'llmgw ctl apply' does
(issue 25, item 1): named, the close key suggested, nothing applied."""

from __future__ import annotations

import pytest

from replicas.models import CatalogEntry

pytestmark = pytest.mark.django_db

ENTRY = "  - name: tiny\n    engine: sim\n    model: /m\n    replica: 3\n"


def test_a_typo_in_an_entry_is_named_in_the_preview_and_not_applied(admin_client_ui, no_reconcile_enqueue):
    preview = admin_client_ui.post("/catalog/", {"yaml": "models:\n" + ENTRY})
    assert preview.status_code == 400
    assert "unknown key; did you mean replicas?" in preview.content.decode()
    applied = admin_client_ui.post("/catalog/apply/", {"yaml": "models:\n" + ENTRY})
    assert applied.status_code == 400 and "did you mean replicas?" in applied.content.decode()
    assert not CatalogEntry.objects.exists()


def test_an_unknown_top_level_key_is_named(admin_client_ui, no_reconcile_enqueue):
    good = "models:\n" + ENTRY.replace("replica:", "replicas:")
    admin_client_ui.post("/catalog/apply/", {"yaml": good})
    assert CatalogEntry.objects.get(name="tiny").replicas == 3
    text = good.replace("models:", "modles:")
    response = admin_client_ui.post("/catalog/", {"yaml": text})
    assert response.status_code == 400
    assert "unknown key; did you mean models?" in response.content.decode()
    # Not an empty catalog, which --prune would apply as "remove everything".
    admin_client_ui.post("/catalog/apply/", {"yaml": text, "prune": "1"})
    assert CatalogEntry.objects.get(name="tiny").removing is False
