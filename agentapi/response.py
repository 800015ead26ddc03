"""An HTTP/1.1 response that leaves in one send."""

from __future__ import annotations

from gunicorn.http import wsgi


class OneWriteResponse(wsgi.Response):
    """gunicorn's response, with the headers held back until the body (or the
    end) so that they leave together: one TLS record and one send per answer
    instead of three (headers, chunk, last chunk), each of which gives up the
    GIL and waits to take it back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held_head = b""

    def send_headers(self) -> None:
        if self.headers_sent:
            return
        lines = self.default_headers()
        lines.extend(f"{k}: {v}\r\n" for k, v in self.headers)
        self.held_head = ("".join(lines) + "\r\n").encode("latin-1")
        self.headers_sent = True

    def _emit_body(self, data: bytes) -> None:
        if self.chunked:
            data = b"%X\r\n%b\r\n" % (len(data), data)
        head, self.held_head = self.held_head, b""
        self.sock.sendall(head + data if head else data)

    def write_whole(self, body: bytes) -> None:
        """A body known in full goes out with its length rather than chunked."""
        if self.chunked and not self.headers_sent:
            self.headers.append(("Content-Length", str(len(body))))
            self.response_length = len(body)
            self.chunked = False
        self.write(body)

    def close(self) -> None:
        if not self.headers_sent:
            self.send_headers()
        head, self.held_head = self.held_head, b""
        tail = b"0\r\n\r\n" if self.chunked else b""
        if head or tail:
            self.sock.sendall(head + tail)
