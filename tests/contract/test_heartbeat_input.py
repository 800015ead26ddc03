"""Heartbeat values the database cannot hold are a 400 naming the field, and
change nothing (they were a 500: the columns are 32-bit, the JSON was not)."""

from __future__ import annotations

import copy

import pytest

from replicas.models import Member
from tests.agent_view import send_heartbeat
from tests.contract.snapshots import db_state

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "field, value",
    [("pid", 2**31), ("pid", 2**63), ("pid", -1), ("exit_code", 2**31), ("exit_code", -(2**31) - 1),
     ("rank", 2**15), ("rank", -1)],
)
def test_engine_numbers_out_of_the_columns_range_are_a_400_naming_the_field(placed, field, value):
    peer, body = placed
    before = db_state()
    bad = copy.deepcopy(body)
    bad["engines"][0][field] = value
    status, reply = send_heartbeat(peer, "node01", bad)
    assert status == 400, reply
    assert field in reply["details"]["engines"]["0"], reply
    assert db_state() == before


def test_the_extremes_the_columns_hold_are_accepted(placed):
    peer, body = placed
    good = copy.deepcopy(body)
    good["engines"][0].update(pid=2**31 - 1, exit_code=-(2**31))
    status, reply = send_heartbeat(peer, "node01", good)
    assert status == 200, reply
    assert Member.objects.get().pid == 2**31 - 1


@pytest.mark.parametrize(
    "path",
    [("mgmt_addr",), ("agent_version",), ("discovery_errors", 0), ("engines", 0, "log_tail", 0),
     ("engines", 0, "member"), ("gpus", 0, "uuid"), ("hcas",)],
)
def test_a_nul_inside_a_string_is_a_400_naming_the_field(placed, path):
    peer, body = placed
    before = db_state()
    bad = copy.deepcopy(body)
    if path == ("hcas",):
        bad["hcas"] = [{"name": "mlx5_0", "fabric": None, "rate": "a\x00b"}]
    elif path == ("discovery_errors", 0):
        bad["discovery_errors"] = ["nvidia-smi \x00 failed"]
    else:
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = "a\x00b"
    # A changed log tail alone is not news (it is stored with the next change): make it news.
    bad["engines"][0]["healthy"] = False
    status, reply = send_heartbeat(peer, "node01", bad)
    assert status == 400, reply
    assert path[0] in reply["details"], reply
    assert db_state() == before
