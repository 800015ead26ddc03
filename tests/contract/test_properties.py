"""Property-based tests of the agent contract (hypothesis).

The control plane's side: whatever an authenticated agent sends as a
heartbeat (any JSON built around agent.protocol's shapes, or any bytes), the
answer is a 200 or a 4xx whose body says what is wrong, naming the field when
there is one, never a 500; and a refused heartbeat writes nothing (the
database and the liveness store are as they were).

The agent's side: ``agent.protocol.from_dict`` on any JSON either parses into
well-typed values or raises ``ProtocolError``, the one error it documents.

Examples are bounded and derandomized: the suite stays fast and CI reproducible.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent import protocol
from agent.protocol import DesiredState, HeartbeatReply, ProtocolError
from tests.agent_view import send_heartbeat
from tests.contract.snapshots import db_state
from tests.contract.conftest import heartbeat_template
from tests.contract.strategies import any_value, json_values, mutated, paths, replaced

pytestmark = pytest.mark.django_db

SERVER = settings(
    max_examples=150, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
AGENT = settings(max_examples=400, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
HEARTBEAT_FIELDS = {f.name for f in dataclasses.fields(protocol.Heartbeat)} | {"inventory", "non_field_errors"}


def check_answer(peer, body) -> None:
    before = db_state()
    status, reply = send_heartbeat(peer, "node01", body)
    assert status == 200 or 400 <= status < 500, (status, reply)
    if status == 200:
        return
    assert reply["error"], reply
    if "details" in reply:
        # A refusal of the heartbeat's content names the fields at fault.
        assert reply["details"] and set(reply["details"]) <= HEARTBEAT_FIELDS, reply
    assert db_state() == before, f"a refused heartbeat ({status}: {reply}) wrote something"


PLACES = paths(heartbeat_template())


@pytest.mark.parametrize("path", PLACES, ids=[".".join(map(str, p)) for p in PLACES])
@settings(SERVER, max_examples=20)
@given(value=any_value)
def test_any_value_in_any_field_of_a_heartbeat_is_accepted_or_refused_naming_it(placed, path, value):
    peer, body = placed
    check_answer(peer, replaced(body, path, value))


@settings(SERVER, max_examples=100)
@given(data=st.data())
def test_any_change_to_a_heartbeat_is_accepted_or_refused_naming_the_field(placed, data):
    peer, body = placed
    check_answer(peer, data.draw(mutated(body)))


@SERVER
@given(body=json_values)
def test_any_json_as_a_heartbeat_is_accepted_or_refused(placed, body):
    peer, _ = placed
    check_answer(peer, body)


@settings(SERVER, max_examples=60)
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_any_bytes_as_a_heartbeat_are_accepted_or_refused(placed, raw):
    peer, _ = placed
    check_answer(peer, raw)


# --- the agent's side ---------------------------------------------------------------------

def assert_well_typed(value, kind) -> None:
    """What the agent reads is of the types the dataclasses declare."""
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            assert_well_typed(getattr(value, f.name), hints[f.name])
    elif origin is list:
        assert isinstance(value, list)
        for item in value:
            assert_well_typed(item, typing.get_args(kind)[0])
    elif origin is dict:
        assert isinstance(value, dict)
        for key, item in value.items():
            assert isinstance(key, str)
            assert_well_typed(item, typing.get_args(kind)[1])
    elif typing.get_args(kind) and type(None) in typing.get_args(kind):
        if value is not None:
            assert_well_typed(value, typing.get_args(kind)[0])
    elif kind is float:
        assert isinstance(value, float) and math.isfinite(value)
    elif kind in (int, str, bool):
        assert type(value) is kind, (value, kind)


def _desired_base() -> dict:
    member = {"member": "m1", "replica": "1", "model": "m", "rank": 0, "engine": "sim", "argv": ["--port", "9"],
              "env": {"A": "1"}, "gpus": [0, 1], "ports": {"http": 9}, "serves_http": True, "health_url": None}
    return {"version": 3, "members": [member]}


def _parse(cls, data) -> None:
    try:
        parsed = cls.from_dict(data)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert_well_typed(parsed, cls)


@AGENT
@given(data=st.data())
def test_any_change_to_a_desired_state_parses_or_raises_protocol_error(data):
    _parse(DesiredState, data.draw(mutated(_desired_base())))


@AGENT
@given(data=st.data())
def test_any_change_to_a_heartbeat_reply_parses_or_raises_protocol_error(data):
    reply = {"node": "node01", "status": "ready", "heartbeat_interval": 5.0, "desired": _desired_base()}
    _parse(HeartbeatReply, data.draw(mutated(reply)))


@AGENT
@given(body=json_values)
def test_any_json_as_a_desired_state_parses_or_raises_protocol_error(body):
    _parse(DesiredState, body)
    _parse(HeartbeatReply, body)


def test_the_examples_still_parse():
    parsed = DesiredState.from_dict(json.loads(json.dumps(_desired_base())))
    assert parsed.members[0].gpus == [0, 1] and parsed.members[0].health_url is None
