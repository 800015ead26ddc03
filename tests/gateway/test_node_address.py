"""The gateway builds every URL to an engine from parts: a node address
that is not one routes nowhere (issue 19, item 2; the heartbeat that would
store one is refused, tests/nodes/test_mgmt_addr.py)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from django.utils import timezone

from tests.conftest import free_port
from tests.factories import CatalogEntryFactory, NodeFactory

pytestmark = pytest.mark.django_db(transaction=True)


class _Internal(BaseHTTPRequestHandler):
    hits: list[str] = []

    def _answer(self):
        type(self).hits.append(self.path)
        body = json.dumps({"internal": "admin secret"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


def test_a_stored_address_that_is_not_one_routes_nowhere(gateway_web, api_key):
    """A row written before heartbeats were checked: the gateway builds its
    URL from the parsed address and port, so the probe's value reaches no
    internal service."""
    from replicas.models import Member, Replica

    internal = ThreadingHTTPServer(("127.0.0.1", free_port()), _Internal)
    _Internal.hits = []
    threading.Thread(target=internal.serve_forever, daemon=True).start()
    try:
        node = NodeFactory(name="evil-node", mgmt_addr=f"::ffff:127.0.0.1]:{internal.server_port}/internal/admin?x=")
        model = CatalogEntryFactory(name="probe-model")
        replica = Replica.objects.create(model=model, status="ready", status_changed_at=timezone.now())
        Member.objects.create(replica=replica, node=node, rank=0, ports={"http": free_port()}, serves_http=True,
                              state="running", healthy=True)
        web = gateway_web(LLMGW_GATEWAY_OPEN="1")
        body = {"model": "probe-model", "messages": [{"role": "user", "content": "hi"}]}
        answer = httpx.post(f"{web.url}/v1/chat/completions", json=body, timeout=30)
        assert "admin secret" not in answer.text
        assert answer.status_code >= 400, answer.text
        assert _Internal.hits == []
    finally:
        internal.shutdown()
        internal.server_close()
