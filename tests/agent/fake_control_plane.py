"""A stand-in for the agent API that can hand out a desired state with members.

Why a fake: until scheduling exists, the real control plane always answers
with an empty desired state, and the agent's supervisor, long-poll and
adoption need members to act on. This is still a real mTLS HTTPS server on
loopback, speaking ``agent.protocol`` with the same CN rule; the tests that
are about the control plane itself use the real agent API.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from agent.protocol import DesiredMember, DesiredState


class FakeControlPlane:
    def __init__(self, *, certfile: str, keyfile: str, cafile: str, port: int, heartbeat_interval: float = 30.0,
                 extra: dict | None = None):
        self.certfile, self.keyfile, self.cafile = certfile, keyfile, cafile
        self.port = port
        self.heartbeat_interval = heartbeat_interval
        # Fields a newer control plane might send: added to every reply, to
        # its desired state and to each member.
        self.extra = dict(extra or {})
        self.cond = threading.Condition()
        self.desired: dict[str, DesiredState] = {}
        self.heartbeats: dict[str, list[dict]] = {}
        self.polls = 0
        self._server: ThreadingHTTPServer | None = None
        self._conns: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # --- what the tests drive -------------------------------------------------------------

    def set_members(self, node: str, members: list[DesiredMember]) -> int:
        with self.cond:
            version = self.desired.get(node, DesiredState(version=0)).version + 1
            self.desired[node] = DesiredState(version=version, members=list(members))
            self.cond.notify_all()
            return version

    def last_heartbeat(self, node: str) -> dict | None:
        with self.cond:
            beats = self.heartbeats.get(node) or []
            return beats[-1] if beats else None

    def wait_heartbeat(self, node: str, predicate, timeout: float, *, since: int = 0) -> dict:
        """The newest heartbeat (from index ``since`` on) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for beat in reversed((self.heartbeats.get(node) or [])[since:]):
                    if predicate(beat):
                        return beat
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no heartbeat from {node} matched within {timeout}s; last: "
                                       f"{(self.heartbeats.get(node) or [None])[-1]}")
                self.cond.wait(remaining)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> "FakeControlPlane":
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.cafile)
        context.load_cert_chain(self.certfile, self.keyfile)
        context.verify_mode = ssl.CERT_REQUIRED
        handler = type("Handler", (_Handler,), {"plane": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler, bind_and_activate=False)
        server.allow_reuse_address = True
        server.daemon_threads = True
        server.server_bind()
        server.server_activate()
        server.socket = context.wrap_socket(server.socket, server_side=True)
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        return self

    def stop(self) -> None:
        """Gone, as a crashed control plane is: listener and open connections closed."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self.cond:
            for conn in list(self._conns):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.cond.notify_all()

    @property
    def running(self) -> bool:
        return self._server is not None

    def desired_json(self, desired: DesiredState) -> dict:
        data = dataclasses.asdict(desired)
        data["members"] = [{**m, **self.extra} for m in data["members"]]
        return {**data, **self.extra}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    plane: FakeControlPlane

    def log_message(self, format, *args):  # noqa: A002
        pass

    def setup(self) -> None:
        super().setup()
        with self.plane.cond:
            self.plane._conns.add(self.connection)

    def finish(self) -> None:
        with self.plane.cond:
            self.plane._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _node(self, suffix: str) -> str | None:
        parts = urlsplit(self.path).path.strip("/").split("/")
        if len(parts) != 5 or parts[:3] != ["agent", "v1", "nodes"] or parts[4] != suffix:
            return None
        node = parts[3]
        cn = dict(x[0] for x in self.connection.getpeercert()["subject"]).get("commonName")
        if cn != node:
            self._json(403, {"error": f"this certificate is for node {cn!r}, not {node!r}"})
            return ""
        return node

    def do_POST(self) -> None:
        node = self._node("heartbeat")
        if node is None:
            return self._json(404, {"error": "no such endpoint"})
        if not node:
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        plane = self.plane
        with plane.cond:
            plane.heartbeats.setdefault(node, []).append(body)
            desired = plane.desired.get(node, DesiredState(version=0))
            plane.cond.notify_all()
        self._json(200, {"node": node, "status": "ready", "heartbeat_interval": plane.heartbeat_interval,
                         "desired": plane.desired_json(desired), **plane.extra})

    def do_GET(self) -> None:
        node = self._node("desired")
        if node is None:
            return self._json(404, {"error": "no such endpoint"})
        if not node:
            return
        query = parse_qs(urlsplit(self.path).query)
        version = int(query.get("version", ["0"])[0])
        wait = float(query.get("wait", ["0"])[0])
        plane = self.plane
        deadline = time.monotonic() + wait
        with plane.cond:
            plane.polls += 1
            while plane.running:
                desired = plane.desired.get(node, DesiredState(version=0))
                remaining = deadline - time.monotonic()
                if desired.version != version or remaining <= 0:
                    break
                plane.cond.wait(min(remaining, 0.5))
            else:
                return
        self._json(200, plane.desired_json(desired))

    def _json(self, status: int, value) -> None:
        payload = json.dumps(value).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            self.close_connection = True
