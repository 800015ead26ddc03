"""Where one HTTP/1.1 request ends in the bytes received so far.

The worker's event loop reads each request whole before a pool thread sees
it (``intake.py``), so it must know when a request is complete: the head up to
its blank line, then ``Content-Length`` bytes of body. That is all this
module decides. gunicorn's parser, in the pool thread, still parses and
validates everything, from bytes that are already there: where the two
disagree, the parser meets the end of its input and the connection closes;
no thread ever waits on a client.

Agents send small heads and bodies with a length (httpx does for JSON).
Anything else is refused here, before a thread is involved: a chunked body
(its length is unknown until it ends), a body over the heartbeat limit, a head
over ``MAX_HEAD`` bytes.
"""

from __future__ import annotations

import json

# gunicorn would accept ~800 KiB of headers (100 fields of 8 KiB); an agent's
# head is a few hundred bytes.
MAX_HEAD = 32 * 1024
_MAX_LENGTH_DIGITS = 15


class Refusal(Exception):
    """A request answered from the event loop, and its connection closed."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message

    def response(self) -> bytes:
        body = json.dumps({"error": self.message}).encode()
        head = (
            f"HTTP/1.1 {self.status} {self.reason}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode("latin-1") + body


def request_end(data: bytes | bytearray, *, max_body: int) -> int | None:
    """The index just past the first whole request in ``data``, or None while
    more bytes are needed. Raises ``Refusal`` for what is never accepted."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        if len(data) > MAX_HEAD:
            raise Refusal(431, "Request Header Fields Too Large", f"the request head is over {MAX_HEAD} bytes")
        if b"\n\n" in data or b"\n\r\n" in data:
            # Lines ended by a bare LF: the parser refuses these with a 400.
            return len(data)
        return None
    if head_end > MAX_HEAD:
        raise Refusal(431, "Request Header Fields Too Large", f"the request head is over {MAX_HEAD} bytes")
    length = _body_length(bytes(data[:head_end]), max_body=max_body)
    end = head_end + 4 + length
    return end if len(data) >= end else None


def _body_length(head: bytes, *, max_body: int) -> int:
    length: int | None = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            raise Refusal(
                411, "Length Required",
                "send the body with a Content-Length: Transfer-Encoding (chunked) is not accepted here",
            )
        if name != b"content-length":
            continue
        value = value.strip()
        if length is not None or not value.isdigit():
            raise Refusal(400, "Bad Request", "the Content-Length header is not one number")
        if len(value) > _MAX_LENGTH_DIGITS:
            raise _too_large(f"more than 10**{_MAX_LENGTH_DIGITS}", max_body)
        length = int(value)
    length = length or 0
    if length > max_body:
        raise _too_large(str(length), max_body)
    return length


def _too_large(declared: str, max_body: int) -> Refusal:
    return Refusal(
        413, "Content Too Large",
        f"a body of {declared} bytes is over the limit of {max_body} (LLMGW_MAX_HEARTBEAT_BYTES); nothing was read",
    )
