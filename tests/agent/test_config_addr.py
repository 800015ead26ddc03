"""agent.yaml's mgmt_addr is an address or a host name, never a URL (issue 19, item 2)."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, load_config

from .conftest import write_yaml

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("addr", ["::ffff:127.0.1.202]:18099/internal/admin?x=", "10.0.0.1:80", "http://10.0.0.1",
                                  "fe80::1", "0.0.0.0"])
def test_a_mgmt_addr_that_is_not_an_address_is_a_configuration_error(sim_node, addr):
    config = sim_node("node01", server="https://127.0.0.1:7443")
    write_yaml(config, mgmt_addr=addr)
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    assert any(e.startswith("mgmt_addr:") for e in caught.value.errors), caught.value.errors


def test_an_address_or_a_host_name_is_accepted(sim_node):
    config = sim_node("node01", server="https://127.0.0.1:7443")
    for addr in ("10.0.0.11", "2001:db8::11", "node01.cluster.example"):
        write_yaml(config, mgmt_addr=addr)
        assert load_config(config).mgmt_addr == addr
