import pytest

from agent.protocol import example_heartbeat
from nodes.models import Node
from tests.conftest import mtls_client


@pytest.mark.django_db(transaction=True)
def test_heartbeat_over_mtls_registers_node(agent_api, client_cert):
    cert, key, ca = client_cert("node01")
    with mtls_client(cert, key, ca) as client:
        r = client.post(f"{agent_api.url}/agent/v1/nodes/node01/heartbeat", json=example_heartbeat().to_dict())
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ready"
    node = Node.objects.get(name="node01")
    assert node.gpus.count() == 8
    assert list(node.fabrics.values_list("name", flat=True)) == ["ib-a"]
