"""Onboarding's paths go into shell commands and the unit's ExecStart: they
are checked, and the unit's words are quoted (issue 19, item 8)."""

from __future__ import annotations

import pytest

from provisioning.onboard.enroll import engine_user_command, systemd_quote, unit_text
from provisioning.onboard.request import onboard_request_check
from provisioning.validation import RequestInvalid

BASE = {"node": "onb-p", "addr": "10.0.0.9"}


@pytest.mark.parametrize("root", ["/opt/my root", "/x;touch /tmp/owned", "/%h/x", "/$HOME/x", "/a/../etc",
                                  '/a"b', "/a\nb", "relative/x"])
def test_an_install_root_that_is_more_than_a_path_is_refused(root):
    with pytest.raises(RequestInvalid) as refused:
        onboard_request_check({**BASE, "root": root})
    assert "root" in refused.value.errors


def test_the_units_command_line_is_quoted_words(settings):
    class Job:
        node_name = "onb-p"
        params = onboard_request_check({**BASE, "root": "/srv/node+1@a"})

    text = unit_text(Job)
    assert ('ExecStart="/srv/node+1@a/opt/llmgw-agent/venv/bin/llmgw-agent" "run" "--config" '
            '"/srv/node+1@a/etc/llmgw/agent.yaml"') in text
    assert f"passwd {settings.LLMGW_ENGINE_USER} " in text
    # What systemd would read as more than a word is escaped.
    assert systemd_quote('/a b/%h/$X/"q"') == '"/a b/%%h/$$X/\\"q\\""'


def test_the_engine_user_is_created_only_where_missing():
    command = engine_user_command("llmgw-engine")
    assert command.startswith("if ! getent passwd llmgw-engine >/dev/null; then")
    assert "useradd --system --user-group" in command and "usermod" not in command


def test_root_is_refused_as_the_engine_user(settings):
    settings.LLMGW_ENGINE_USER = "root"
    with pytest.raises(RequestInvalid) as refused:
        onboard_request_check(BASE)
    assert "engine_user" in refused.value.errors
