"""Loopback servers for weights tests: a file server with range requests and
faults on demand, which also speaks the parts of the Hugging Face hub API
that ``huggingface_hub`` uses (model info at a revision with its siblings and
their LFS sha256, HEAD and GET on ``/{repo}/resolve/{revision}/{file}``).

Started by a test (``with WeightsServer() as server``), stopped after; one
thread per connection, bound to 127.0.0.1 on a free port.

A repository added with ``token=`` is gated: model info and its resolve
URLs answer 401 (``X-Error-Code: GatedRepo``, as the hub does) unless the
request carries ``Authorization: Bearer <token>``. With ``cdn`` set to
another server, a repository's LFS files are served as the hub serves them:
the resolve URL answers 302 to the CDN, which holds them at an unguessable
path and asks for no token. ``authorizations`` lists each request's path and
its Authorization header ('' when none), so a test can tell where a token
went.

Faults, per served path (``server.fault(path, ...)``), each for ``times``
requests: ``cut_after`` bytes of the body then the connection is closed (a
link cut mid-file); ``corrupt``: the body's bytes are wrong (same length);
``rate``: bytes per second (a slow link). ``served[path]`` counts the body
bytes actually sent, so a test can tell how much a resume fetched again.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Fault:
    cut_after: int | None = None
    corrupt: bool = False
    rate: float | None = None
    times: int = 1


@dataclass
class Repo:
    commit: str
    files: dict[str, bytes]
    lfs: set[str]
    refs: dict[str, str]
    token: str | None = None  # gated: only with this token


class WeightsServer:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.files: dict[str, bytes] = {}
        self.repos: dict[str, Repo] = {}
        self.faults: dict[str, Fault] = {}
        self.served: Counter[str] = Counter()
        self.requests: list[tuple[str, str, str]] = []
        self.authorizations: list[tuple[str, str]] = []
        self.cdn: WeightsServer | None = None
        self.rate: float | None = None  # every file, bytes per second (a link of fixed bandwidth)
        self.active = 0  # file bodies being sent now, and the most at once
        self.max_active = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                server._handle(self, head=True)

            def do_GET(self) -> None:  # noqa: N802
                server._handle(self, head=False)

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="weights-server", daemon=True)

    # -- content --------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def add_files(self, prefix: str, files: dict[str, bytes], *, revision: str | None = None) -> str:
        """Files under /files/<prefix>/ with a manifest.json; returns the base URL."""
        for name, data in files.items():
            self.files[f"/files/{prefix}/{name}"] = data
        manifest = {"files": [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                              for n, d in sorted(files.items())]}
        if revision:
            manifest["revision"] = revision
        self.files[f"/files/{prefix}/manifest.json"] = json.dumps(manifest).encode()
        return f"{self.url}/files/{prefix}/"

    def add_repo(self, repo: str, files: dict[str, bytes], *, lfs: set[str] | None = None,
                 refs: dict[str, str] | None = None, token: str | None = None) -> str:
        """A hub repository at one commit; ``lfs``: files kept in LFS (default:
        those over 1 KiB); ``token``: gated, readable only with it. Returns the commit."""
        commit = hashlib.sha1(repr(sorted((n, hashlib.sha256(d).hexdigest()) for n, d in files.items()))
                              .encode()).hexdigest()
        lfs = {n for n, d in files.items() if len(d) > 1024} if lfs is None else lfs
        self.repos[repo] = Repo(commit, dict(files), set(lfs), {"main": commit, **(refs or {})}, token)
        return commit

    def fault(self, path: str, **kwargs) -> None:
        self.faults[path] = Fault(**kwargs)

    def resolve_path(self, repo: str, name: str, revision: str) -> str:
        return f"/{repo}/resolve/{revision}/{name}"

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> "WeightsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "WeightsServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- serving --------------------------------------------------------------

    def _handle(self, handler: BaseHTTPRequestHandler, *, head: bool) -> None:
        parts = urlsplit(handler.path)
        path = unquote(parts.path)
        with self._lock:
            self.requests.append((handler.command, path, handler.headers.get("Range", "")))
            self.authorizations.append((path, handler.headers.get("Authorization", "")))
        match = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/(.+))?$", path)
        if match:
            repo = self.repos.get(match.group(1))
            if repo is not None and not self._granted(handler, repo):
                return self._error(handler, 401, "GatedRepo", head, "Access to this repository is restricted")
            return self._model_info(handler, match.group(1), match.group(2) or "main")
        match = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if match:
            repo = self.repos.get(match.group(1))
            if repo is None:
                return self._error(handler, 404, "RepoNotFound", head)
            if not self._granted(handler, repo):
                return self._error(handler, 401, "GatedRepo", head, "Access to this repository is restricted")
            commit = repo.refs.get(match.group(2), match.group(2))
            if commit != repo.commit:
                return self._error(handler, 404, "RevisionNotFound", head)
            name = match.group(3)
            if name not in repo.files:
                return self._error(handler, 404, "EntryNotFound", head)
            data = repo.files[name]
            sha = hashlib.sha256(data).hexdigest()
            extra = {"X-Repo-Commit": commit, "ETag": f'"{sha if name in repo.lfs else hashlib.sha1(data).hexdigest()}"'}
            if name in repo.lfs:
                extra |= {"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data))}
                if self.cdn is not None:
                    where = f"/cdn/{sha}"
                    self.cdn.files[where] = data
                    return self._redirect(handler, self.cdn.url + where, extra)
            return self._send_file(handler, path, data, head, extra)
        if path in self.files:
            return self._send_file(handler, path, self.files[path], head, {})
        return self._error(handler, 404, "EntryNotFound", head)

    @staticmethod
    def _granted(handler, repo: Repo) -> bool:
        return repo.token is None or handler.headers.get("Authorization", "") == f"Bearer {repo.token}"

    @staticmethod
    def _redirect(handler, location: str, extra: dict[str, str]) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        for key, value in extra.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def _model_info(self, handler, name: str, revision: str) -> None:
        repo = self.repos.get(name)
        if repo is None:
            return self._error(handler, 404, "RepoNotFound", False, "Repository not found")
        commit = repo.refs.get(revision, revision)
        if commit != repo.commit:
            return self._error(handler, 404, "RevisionNotFound", False, f"Invalid rev id: {revision}")
        siblings = []
        for fname, data in sorted(repo.files.items()):
            sibling = {"rfilename": fname, "size": len(data), "blobId": hashlib.sha1(data).hexdigest()}
            if fname in repo.lfs:
                sibling["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(sibling)
        body = json.dumps({"id": name, "modelId": name, "sha": commit, "private": False,
                           "siblings": siblings}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _error(self, handler, code: int, error_code: str, head: bool, message: str = "") -> None:
        body = json.dumps({"error": message or error_code}).encode()
        handler.send_response(code)
        handler.send_header("X-Error-Code", error_code)
        handler.send_header("X-Error-Message", message or error_code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    def _send_file(self, handler, path: str, data: bytes, head: bool, extra: dict[str, str]) -> None:
        start, end = 0, len(data)
        status = 200
        spec = handler.headers.get("Range")
        if spec:
            match = RANGE_RE.match(spec.strip())
            if not match or int(match.group(1)) >= len(data) and len(data):
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{len(data)}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
            start = int(match.group(1))
            end = min(len(data), int(match.group(2)) + 1) if match.group(2) else len(data)
            status = 206
        body = data[start:end]
        handler.send_response(status)
        handler.send_header("Content-Length", str(len(body)))
        handler.send_header("Accept-Ranges", "bytes")
        if status == 206:
            handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        for key, value in extra.items():
            handler.send_header(key, value)
        handler.end_headers()
        if head:
            return
        fault = None
        if not head:
            with self._lock:
                fault = self.faults.get(path)
                if fault is not None:
                    fault.times -= 1
                    if fault.times <= 0:
                        del self.faults[path]
        if fault is not None and fault.corrupt:
            body = bytes(b ^ 0x5A for b in body)
        limit = len(body) if fault is None or fault.cut_after is None else min(len(body), fault.cut_after)
        rate = (fault.rate if fault is not None and fault.rate else None) or self.rate
        chunk = 64 * 1024 if rate is None else max(1024, int(rate / 20))
        sent = 0
        began = time.monotonic()
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            while sent < limit:
                piece = body[sent:min(limit, sent + chunk)]
                handler.wfile.write(piece)
                sent += len(piece)
                with self._lock:
                    self.served[path] += len(piece)
                if rate:
                    ahead = sent / rate - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True
            return
        finally:
            with self._lock:
                self.active -= 1
        if sent < len(body):
            # The link cut mid-file: the client sees a short body.
            handler.close_connection = True
            try:
                handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
