"""The catalog: declarative apply, field-named refusals, never-fits reasons."""

import pytest

from core.models import Event
from replicas.catalog import CatalogInvalid, catalog_apply, model_scale
from replicas.models import CatalogEntry
from tests.factories import node_with_gpus

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("no_reconcile_enqueue")]

ENTRY = {"name": "llama-70b", "engine": "vllm", "model": "/models/llama-70b", "nodes": 2, "gpus_per_node": 4,
         "replicas": 2, "args": ["--max-model-len", "8192"], "env": {"VLLM_LOGGING_LEVEL": "INFO"}}


def test_apply_is_declarative_and_idempotent():
    assert catalog_apply(entries=[ENTRY])["created"] == ["llama-70b"]
    assert catalog_apply(entries=[ENTRY])["unchanged"] == ["llama-70b"]
    changed = dict(ENTRY, replicas=3)
    assert catalog_apply(entries=[changed])["updated"] == ["llama-70b"]
    model = CatalogEntry.objects.get(name="llama-70b")
    assert (model.weights, model.replicas, model.args, model.env) == (
        "/models/llama-70b", 3, ["--max-model-len", "8192"], {"VLLM_LOGGING_LEVEL": "INFO"})


def test_prune_removes_what_the_file_no_longer_lists():
    catalog_apply(entries=[ENTRY, dict(ENTRY, name="other")])
    result = catalog_apply(entries=[ENTRY], prune=True)
    assert result["removed"] == ["other"]
    other = CatalogEntry.objects.get(name="other")
    assert other.removing and other.replicas == 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"engine": "tgi"}, "engine"),
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": "four"}, "gpus_per_node"),
        ({"args": ["--tp", "4"]}, "args"),
        ({"args": ["--tensor-parallel-size", "3"]}, "args"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "env"),
        ({"name": "bad name!"}, "name"),
    ],
)
def test_malformed_entry_is_refused_with_the_field_named_and_nothing_changes(change, field):
    catalog_apply(entries=[dict(ENTRY, name="keep")])
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[dict(ENTRY, name="new"), dict(ENTRY, **change)], prune=True)
    assert any(f": {field}: " in error for error in caught.value.errors), caught.value.errors
    assert list(CatalogEntry.objects.values_list("name", flat=True)) == ["keep"]
    assert not CatalogEntry.objects.get(name="keep").removing


def test_entry_that_can_never_fit_is_accepted_and_says_why():
    node_with_gpus("node01", fabric="ib-a")
    node_with_gpus("node02", gpus=4)
    catalog_apply(entries=[dict(ENTRY, name="huge", nodes=4, gpus_per_node=8, args=[])])
    model = CatalogEntry.objects.get(name="huge")
    assert model.never_fits_reason
    assert "4 nodes" in model.never_fits_reason
    assert Event.objects.filter(subject="model/huge", severity="error").exists()


def test_scale_unknown_model_names_it():
    from core.exceptions import NotFound

    with pytest.raises(NotFound, match="no model named 'ghost'"):
        model_scale(name="ghost", replicas=1)


def test_routing_policy_is_a_catalog_field_that_reaches_the_gateway_snapshot():
    from gateway.selectors import routing_snapshot

    catalog_apply(entries=[ENTRY])
    assert CatalogEntry.objects.get(name="llama-70b").routing == "cache-aware"  # the default
    assert catalog_apply(entries=[dict(ENTRY, routing="session")])["updated"] == ["llama-70b"]
    assert routing_snapshot().policies == {"llama-70b": "session"}
    with pytest.raises(CatalogInvalid) as refused:
        catalog_apply(entries=[dict(ENTRY, routing="fastest")])
    assert "routing" in str(refused.value) and "fastest" in str(refused.value)
    assert CatalogEntry.objects.get(name="llama-70b").routing == "session"  # nothing changed


SIM = {"name": "sim-8b", "engine": "sim", "model": "/models/sim-8b", "nodes": 1, "gpus_per_node": 1, "replicas": 1}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-num-seq", "8"], "--max-num-seq: abbreviated sim flag (could be --max-num-seqs)"),
        (["--kv-cache-size", "100"], "--kv-cache-size: unknown sim flag"),
        (["--max-num-seqs", "eight"], "--max-num-seqs eight: must be a whole number of at least 1"),
        (["--block-size", "0"], "--block-size 0: must be a whole number of at least 1"),
        (["--prefill-time-per-token", "-0.1"], "--prefill-time-per-token -0.1: must be a number of seconds"),
        (["--enable-prefix-caching=no"], "--enable-prefix-caching=no: takes no value"),
        (["--num-gpu-blocks-override", "1000"], "--max-model-len 32768 is more than the sim's KV cache holds"),
        (["--port", "9000"], "sim flag --port is set by llmgw"),
    ],
)
def test_a_sim_flag_the_engine_does_not_take_is_refused_at_apply(args, message):
    with pytest.raises(CatalogInvalid) as caught:
        catalog_apply(entries=[dict(SIM, args=args)])
    assert any(": args: " in e and message in e for e in caught.value.errors), caught.value.errors
    assert not CatalogEntry.objects.exists()


def test_the_sim_performance_model_is_set_per_catalog_entry():
    args = ["--max-num-seqs", "32", "--num-gpu-blocks-override", "2000", "--max-model-len", "16384",
            "--no-enable-prefix-caching", "--decode-step-base=0.02", "--token-delay", "0.01"]
    assert catalog_apply(entries=[dict(SIM, args=args)])["created"] == ["sim-8b"]
    assert CatalogEntry.objects.get(name="sim-8b").args == args
