"""Where one HTTP/1.1 request ends in the bytes received so far.

The worker's event loop reads each request whole before a pool thread sees
it (``intake.py``), so it must know when a request is complete: the head up to
its blank line, then ``Content-Length`` bytes of body, or chunks up to the
last one and its trailers. That is all this module decides. gunicorn's parser,
in the pool thread, still parses and validates everything, from bytes that
are already there: where the two disagree, the parser meets the end of its
input and the connection closes; no thread ever waits on a client.

Refused here, before a thread is involved: a body over the heartbeat limit
(declared, or counted as its chunks arrive), a head over ``MAX_HEAD`` bytes,
a length or chunk size that is not a number.

Each connection keeps one ``Framing`` that resumes where the last look
stopped, so a request trickling in a byte at a time costs a look at each new
byte, not at the whole buffer again.
"""

from __future__ import annotations

import json
import re

# gunicorn would accept ~800 KiB of headers (100 fields of 8 KiB); an agent's
# head is a few hundred bytes.
MAX_HEAD = 32 * 1024
_MAX_LENGTH_DIGITS = 15
_MAX_CHUNK_LINE = 1024
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")


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


class Framing:
    """The end of the first request in a growing buffer (which starts with it)."""

    def __init__(self, *, max_body: int) -> None:
        self.max_body = max_body
        self.reset()

    def reset(self) -> None:
        self._scanned = 0  # bytes of the head already searched for its end
        self._body_start: int | None = None
        self._length: int | None = None  # Content-Length; None while chunked
        self._chunk_at = 0  # where the next chunk-size line starts
        self._chunked_total = 0

    def end(self, data: bytes | bytearray) -> int | None:
        """The index just past the first whole request in ``data``, or None
        while more bytes are needed. Raises ``Refusal`` for what is never
        accepted."""
        if self._body_start is None and not self._find_head(data):
            return None
        if self._length is not None:
            end = self._body_start + self._length
            return end if len(data) >= end else None
        return self._chunked_end(data)

    def _find_head(self, data: bytes | bytearray) -> bool:
        head_end = data.find(b"\r\n\r\n", max(0, self._scanned - 3))
        if head_end < 0:
            self._scanned = len(data)
            if len(data) > MAX_HEAD:
                raise _head_too_large()
            if data.find(b"\n\n") >= 0 or data.find(b"\n\r\n") >= 0:
                # Lines ended by a bare LF: hand it on, the parser answers 400.
                self._body_start, self._length = len(data), 0
                return True
            return False
        if head_end > MAX_HEAD:
            raise _head_too_large()
        self._body_start = head_end + 4
        self._read_head(bytes(data[:head_end]))
        self._chunk_at = self._body_start
        return True

    def _read_head(self, head: bytes) -> None:
        length: int | None = None
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding":
                chunked = True
            elif name == b"content-length":
                value = value.strip()
                if length is not None or not value.isdigit():
                    raise Refusal(400, "Bad Request", "the Content-Length header is not one number")
                if len(value) > _MAX_LENGTH_DIGITS:
                    raise _too_large(f"more than 10**{_MAX_LENGTH_DIGITS}", self.max_body)
                length = int(value)
        if chunked:
            # Chunked, or a Transfer-Encoding the parser refuses (with a 400,
            # as it does Content-Length beside it): count what arrives.
            return
        length = length or 0
        if length > self.max_body:
            raise _too_large(str(length), self.max_body)
        self._length = length

    def _chunked_end(self, data: bytes | bytearray) -> int | None:
        while True:
            at = self._chunk_at
            line_end = data.find(b"\r\n", at)
            if line_end < 0:
                if len(data) - at > _MAX_CHUNK_LINE:
                    raise _bad_chunk()
                return None
            size_text = bytes(data[at:line_end]).split(b";", 1)[0].strip(b" \t")
            if not _CHUNK_SIZE.fullmatch(size_text):
                raise _bad_chunk()
            size = int(size_text, 16)
            if size == 0:
                # The last chunk: then trailer lines, if any, and a blank line.
                if data[line_end + 2 : line_end + 4] == b"\r\n":
                    return line_end + 4
                trailers_end = data.find(b"\r\n\r\n", line_end + 2)
                if trailers_end < 0:
                    if len(data) - line_end > MAX_HEAD:
                        raise _head_too_large()
                    return None
                return trailers_end + 4
            self._chunked_total += size
            if self._chunked_total > self.max_body:
                raise _too_large(f"more than {self.max_body}", self.max_body)
            next_at = line_end + 2 + size + 2
            if len(data) < next_at:
                self._chunked_total -= size  # counted again when the rest arrives
                return None
            self._chunk_at = next_at


def _too_large(declared: str, max_body: int) -> Refusal:
    return Refusal(
        413, "Content Too Large",
        f"a body of {declared} bytes is over the limit of {max_body} (LLMGW_MAX_HEARTBEAT_BYTES); nothing was read",
    )


def _head_too_large() -> Refusal:
    return Refusal(431, "Request Header Fields Too Large", f"the request head is over {MAX_HEAD} bytes")


def _bad_chunk() -> Refusal:
    return Refusal(400, "Bad Request", "a chunk of the body does not start with its size in hexadecimal")
