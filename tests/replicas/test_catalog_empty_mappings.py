"""Empty or null nested mappings in a catalog entry: a clear 400 or the
defaults, never a server error (the schema fuzzer met one at POST /models/)."""

import pytest

from replicas.catalog import CatalogInvalid, catalog_upsert
from replicas.models import CatalogEntry

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

ENTRY = {"name": "tiny", "engine": "sim", "weights": "/m", "nodes": 1, "gpus_per_node": 1, "replicas": 1}


def test_empty_timeouts_mean_the_settings_defaults():
    catalog_upsert(entry={**ENTRY, "timeouts": {}})
    assert CatalogEntry.objects.get(name="tiny").timeouts is None
    catalog_upsert(entry={**ENTRY, "timeouts": {"ttft": None, "total": 600}})
    assert CatalogEntry.objects.get(name="tiny").timeouts == {"total": 600.0}


def test_a_null_source_and_a_blank_model_are_refused_by_name():
    body = {**ENTRY, "name": "0", "weights": "", "source": None, "timeouts": {}, "autoscale": None}
    with pytest.raises(CatalogInvalid) as refused:
        catalog_upsert(entry=body)
    assert "weights: This field may not be blank." in str(refused.value)
    assert "source: This field may not be null." in str(refused.value)
    assert not CatalogEntry.objects.filter(name="0").exists()
