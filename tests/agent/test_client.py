"""The pieces of the link to the control plane that need no server to test."""

from __future__ import annotations

import logging
import random

from agent.client import Backoff, LinkLog, Refused, ServerError, Unreachable
from agent.protocol import DesiredMember, DesiredState
from agent.runner import DesiredHolder


def test_backoff_grows_from_base_to_ceiling_with_jitter():
    backoff = Backoff(0.5, 8.0, rng=random.Random(1))
    delays = [backoff.next() for _ in range(10)]
    ceilings = [min(8.0, 0.5 * 2**i) for i in range(10)]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings)), delays
    assert len({round(d, 6) for d in delays[5:]}) > 1, "jittered, so agents do not come back in lockstep"
    backoff.reset()
    assert backoff.next() <= 0.5


def test_link_state_is_logged_once_per_change(caplog):
    link = LinkLog("https://cp:7443")
    with caplog.at_level(logging.INFO, logger="agent.client"):
        link.up()
        for _ in range(5):
            link.failed(Unreachable("[Errno 111] Connection refused"), retry_in=1)
        link.failed(Unreachable("timed out"), retry_in=2)  # still unreachable: not news
        link.failed(ServerError("502: bad gateway"), retry_in=2)
        link.up()
        link.up()
        link.failed(Refused("this certificate is for node 'b', not 'a'"), retry_in=30)
        link.failed(Refused("this certificate is for node 'b', not 'a'"), retry_in=30)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5, messages
    assert messages[0] == "control plane reachable at https://cp:7443"
    assert messages[1].startswith("control plane unreachable at https://cp:7443: [Errno 111] Connection refused")
    assert messages[2].startswith("control plane server error at https://cp:7443: 502: bad gateway")
    assert messages[3] == "control plane reachable again at https://cp:7443 after 7 failed attempts"
    assert messages[4].startswith("control plane refused this agent (403): this certificate is for node 'b'")


def _state(version: int, *members: str) -> DesiredState:
    return DesiredState(version=version, members=[
        DesiredMember(member=m, replica="r", model="m", rank=0, engine="sim", argv=["x"], env={}, gpus=[],
                      ports={}, serves_http=False) for m in members
    ])


def test_a_late_reply_never_takes_the_agent_back():
    holder = DesiredHolder()
    assert holder.offer(_state(0), asked_with=0)
    assert holder.take().version == 0 and holder.take() is None
    assert holder.offer(_state(3, "a"), asked_with=0)  # from the long-poll
    # A heartbeat sent while we held version 0, answered late with version 2:
    assert not holder.offer(_state(2), asked_with=0)
    assert not holder.offer(_state(3, "a"), asked_with=3)  # same version: nothing new
    assert holder.take().members[0].member == "a"
    assert holder.version == 3


def test_a_control_plane_that_really_went_back_is_followed():
    holder = DesiredHolder()
    holder.offer(_state(7, "a"), asked_with=0)
    holder.take()
    # Asked while holding 7, answered 1: the control plane's state was restored.
    assert holder.offer(_state(1), asked_with=7)
    assert holder.take().version == 1
