"""A candidate listener for the agent API, for ``bench/heartbeats.py --server``
only (docs/benchmarks.md, "The listener's shape"): uvicorn (httptools,
uvloop) with the peer certificate read from the transport once per
connection, in front of Django's ASGI handler (``app_asgi``) or of Django's
WSGI handler run in a thread pool (``app_wsgi``).

Not a product path: it has none of the listener's hostile-client guards
(handshake and request deadlines, the head limit, the per-certificate cap)
and no long-poll parking. uvicorn 0.54 does not pass the client certificate
to the application, hence the protocol subclass.
"""
import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO

os.environ["LLMGW_ROLE"] = "agent-api"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw_site.settings")
import django  # noqa: E402

django.setup()
from django.core.asgi import ASGIHandler  # noqa: E402
from django.core.handlers.asgi import ASGIRequest  # noqa: E402
from django.core.wsgi import get_wsgi_application  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402


class _PeerSock:
    __slots__ = ("der",)

    def __init__(self, der):
        self.der = der

    def getpeercert(self, binary_form=False):
        return self.der


class PeerProtocol(HttpToolsProtocol):
    def connection_made(self, transport):
        super().connection_made(transport)
        ssl_object = transport.get_extra_info("ssl_object")
        self.peer = _PeerSock(ssl_object.getpeercert(binary_form=True) if ssl_object else None)

    def on_message_begin(self):
        super().on_message_begin()
        self.scope["extensions"] = {"llmgw.peer": self.peer}


class PeerRequest(ASGIRequest):
    def __init__(self, scope, body_file):
        super().__init__(scope, body_file)
        self.META["gunicorn.socket"] = scope["extensions"]["llmgw.peer"]


class PeerASGIHandler(ASGIHandler):
    request_class = PeerRequest


app_asgi = PeerASGIHandler()

_wsgi = get_wsgi_application()
_pool = ThreadPoolExecutor(16)


def _call(environ):
    out = {}

    def start_response(status, headers, exc_info=None):
        out["status"] = int(status[:3])
        out["headers"] = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]

    result = _wsgi(environ, start_response)
    try:
        body = b"".join(result)
    finally:
        if hasattr(result, "close"):
            result.close()
    return out["status"], out["headers"], body


async def app_wsgi(scope, receive, send):
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    environ = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": "",
        "PATH_INFO": scope["path"],
        "QUERY_STRING": scope["query_string"].decode("latin-1"),
        "SERVER_NAME": scope["server"][0],
        "SERVER_PORT": str(scope["server"][1]),
        "SERVER_PROTOCOL": "HTTP/" + scope["http_version"],
        "REMOTE_ADDR": scope["client"][0],
        "wsgi.url_scheme": scope["scheme"],
        "wsgi.input": BytesIO(body),
        "wsgi.errors": None,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
        "gunicorn.socket": scope["extensions"]["llmgw.peer"],
        "CONTENT_LENGTH": str(len(body)),
    }
    for name, value in scope["headers"]:
        key = name.decode("latin-1").upper().replace("-", "_")
        if key == "CONTENT_TYPE":
            environ["CONTENT_TYPE"] = value.decode("latin-1")
        elif key != "CONTENT_LENGTH":
            environ["HTTP_" + key] = value.decode("latin-1")
    status, headers, payload = await asyncio.get_running_loop().run_in_executor(_pool, _call, environ)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
