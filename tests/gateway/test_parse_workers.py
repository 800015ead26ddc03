"""The processes that parse large /v1 bodies die with the web process that
started them, even when it is killed outright and cannot shut its pool down."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from cli.wait import wait_until


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes whose parent is ``pid``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found[int(entry.name)] = argv
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_killed_web_process_leaves_no_parsing_process_behind(gateway_web, make_replica, fake_engine, api_key):
    engine = fake_engine("m")
    make_replica("m", engine.port)
    key = api_key()
    web = gateway_web(LLMGW_GATEWAY_INLINE_PARSE_BYTES="16")  # every body goes to the pool
    response = httpx.post(f"{web.url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                          json={"model": "m", "messages": [{"role": "user", "content": "parsed elsewhere"}]})
    assert response.status_code == 200, response.text
    parsers = {pid: argv for pid, argv in _children(web.proc.pid).items() if "multiprocessing" in argv}
    assert parsers, f"the web process started no parsing process: {_children(web.proc.pid)}"

    os.kill(web.proc.pid, signal.SIGKILL)  # the process alone, not its group: no shutdown runs
    web.proc.wait(timeout=10)
    wait_until(lambda: not any(_alive(pid) for pid in parsers), timeout=5,
               message=f"the parsing processes {sorted(parsers)} to die with the web process")
