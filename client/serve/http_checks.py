"""What the HTTP guard (client/serve/http_guard.py) checks in a request before tritonserver sees it.

tritonserver 2.51's HTTP frontend dies (SIGSEGV) on two kinds of single request, both fixed
upstream after 2.51:
  - a form-urlencoded body of 5 MB or more (libevhtp parses such a body as form fields;
    triton-inference-server/server#5840): the guard never forwards that content type (a
    form-urlencoded or text/plain body, what `curl -d` sends, is forwarded as application/json)
    and caps every body at `max_body_bytes`;
  - JSON nested ~200,000 levels deep (the JSON parser recurses per level;
    triton-inference-server/common#156): the guard rejects JSON nested deeper than
    `max_json_depth`.
Pure functions on bytes (and the HTTP/1.1 head parsing the guard needs), unit-tested without sockets.
"""
from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np


@dataclass(frozen=True)
class GuardLimits:
    """Per-request limits; each is an option of `tritium serve` and of the guard (--max-body-bytes, ...)."""
    max_body_bytes: int = 4 * 1024 * 1024  # after decompression; below 2.51's 5 MB form crash
    max_json_depth: int = 64               # a Triton request needs < 10 (object, inputs, data, rank)
    max_header_bytes: int = 64 * 1024      # request line + headers
    max_connections: int = 1024            # open client connections at once
    max_buffered_bytes: int = 512 * 1024 * 1024  # request bodies held at once, all connections


class GuardError(Exception):
    """A request the guard answers itself: HTTP `status` with {"error": message}."""

    def __init__(self, status: int, message: str, headers: Tuple[Tuple[str, str], ...] = ()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers  # extra response headers (WWW-Authenticate on a 401)


# Content types forwarded as they are; those in _AS_JSON are forwarded as application/json.
PASS_CONTENT_TYPES = ("application/json", "application/octet-stream")
_AS_JSON = ("application/x-www-form-urlencoded", "text/plain", "")


def forward_content_type(value: Optional[str]) -> Optional[str]:
    """The Content-Type to send upstream for a client's Content-Type (None: send none).

    Raises GuardError 415 for anything that is not JSON-like (multipart/form-data, ...).
    """
    if value is None:
        return None
    base = value.split(";", 1)[0].strip().lower()
    if base in PASS_CONTENT_TYPES:
        return base
    if base in _AS_JSON:
        return "application/json"
    raise GuardError(415, f"Content-Type {base!r} is not accepted; send application/json "
                          f"(form-urlencoded and text/plain bodies are read as JSON)")


def parse_content_length(values) -> Optional[int]:
    """The single Content-Length of a request (None if absent); 400 if repeated or not a number."""
    if not values:
        return None
    if len(set(v.strip() for v in values)) != 1 or not values[0].strip().isdigit():
        raise GuardError(400, f"bad Content-Length {values!r}")
    return int(values[0].strip())


def check_body_size(num_bytes: int, limits: GuardLimits) -> None:
    if num_bytes > limits.max_body_bytes:
        raise GuardError(413, f"request body of {num_bytes} bytes is over the limit of {limits.max_body_bytes} "
                              f"bytes (--max-body-bytes)")


def decode_body(body: bytes, encoding: Optional[str], limits: GuardLimits) -> bytes:
    """Undo Content-Encoding gzip / deflate (as tritonclient sends them), never past the body limit.

    The guard checks and forwards the decoded body, so a small compressed body cannot hide a
    large or deeply nested one.
    """
    enc = (encoding or "identity").strip().lower()
    if enc == "identity":
        return body
    if enc not in ("gzip", "deflate"):
        raise GuardError(415, f"Content-Encoding {enc!r} is not accepted; allowed: identity, gzip, deflate")
    out = b""
    for wbits in ((16 + zlib.MAX_WBITS,) if enc == "gzip" else (zlib.MAX_WBITS, -zlib.MAX_WBITS)):
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(body, limits.max_body_bytes + 1)
        except zlib.error:
            continue
        if len(out) > limits.max_body_bytes or d.unconsumed_tail:
            raise GuardError(413, f"decompressed request body is over the limit of {limits.max_body_bytes} bytes "
                                  f"(--max-body-bytes)")
        if d.eof:
            return out
    raise GuardError(400, f"request body is not valid {enc} data")


# A JSON string literal (escapes included), unrolled so that matching stays linear.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def json_depth(data: bytes) -> int:
    """Deepest nesting of [ ] and { } in JSON text, brackets inside strings not counted."""
    if not data:
        return 0
    arr = np.frombuffer(_JSON_STRING.sub(b'""', data), dtype=np.uint8)
    step = ((arr == ord("[")) | (arr == ord("{"))).astype(np.int32) - ((arr == ord("]")) | (arr == ord("}")))
    return int(np.cumsum(step).max(initial=0))


def check_json_depth(data: bytes, limits: GuardLimits) -> None:
    """Raise GuardError 400 if the JSON text nests deeper than limits.max_json_depth."""
    # Cheap bound first: fewer opening brackets than the limit cannot nest past it.
    if data.count(b"[") + data.count(b"{") <= limits.max_json_depth:
        return
    depth = json_depth(data)
    if depth > limits.max_json_depth:
        raise GuardError(400, f"JSON nesting depth {depth} is over the limit of {limits.max_json_depth} "
                              f"(--max-json-depth)")


def check_json_syntax(data: bytes):
    """The parsed JSON of `data` (None if empty); GuardError 400 unless it is UTF-8 JSON:
    tritonserver 2.51 answers a malformed JSON body with a 500, never right for a client's mistake."""
    if not data.strip():
        return None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise GuardError(400, f"the request body is not UTF-8 (byte {e.start}); JSON must be UTF-8") from None
    except ValueError as e:  # after check_json_depth: no RecursionError here
        raise GuardError(400, f"the request body is not valid JSON: {e}") from None


def json_part(body: bytes, header_length: Optional[str]) -> bytes:
    """The JSON part of an inference body: all of it, or the first Inference-Header-Content-Length
    bytes when binary tensor data follows (Triton's binary data extension)."""
    if header_length is None:
        return body
    v = header_length.strip()
    if not v.isdigit() or int(v) > len(body):
        raise GuardError(400, f"bad Inference-Header-Content-Length {header_length!r} for a {len(body)}-byte body")
    return body[:int(v)]


# ---- HTTP/1.1 message heads ------------------------------------------------------------------
_REASONS = {400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 413: "Payload Too Large",
            415: "Unsupported Media Type",
            431: "Request Header Fields Too Large", 501: "Not Implemented", 502: "Bad Gateway",
            503: "Service Unavailable"}


class Request:
    """An HTTP/1.1 request head: method, target, version and headers in order."""

    def __init__(self, method: str, target: str, version: str, headers: List[Tuple[str, str]]):
        self.method, self.target, self.version, self.headers = method, target, version, headers

    def get_all(self, name: str) -> List[str]:
        return [v for k, v in self.headers if k.lower() == name]

    def get(self, name: str) -> Optional[str]:
        vals = self.get_all(name)
        return vals[-1] if vals else None

    @property
    def keep_alive(self) -> bool:
        conn = ",".join(self.get_all("connection")).lower()
        return "keep-alive" in conn if self.version == "HTTP/1.0" else "close" not in conn


def parse_head(head: bytes) -> Request:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[1].startswith("/") or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise GuardError(400, "bad request line")
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise GuardError(400, "bad header line")
        headers.append((name, value.strip()))
    return Request(parts[0], parts[1], parts[2], headers)


def error_response(status: int, message: str, headers: Tuple[Tuple[str, str], ...] = ()) -> bytes:
    body = json.dumps({"error": f"tritium guard: {message}"}).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
    return (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


# tritonserver 2.51 answers these client mistakes with a 5xx (its request converters use
# TRITONSERVER_ERROR_INTERNAL / UNSUPPORTED): the guard passes them on as 400.
_CLIENT_MISTAKES = (b'{"error":"Unable to parse ', b'{"error":"failed to parse ',
                    b'{"error":"HTTP end point doesn\'t support models with decoupled')


def upstream_status(status: int, body: bytes) -> int:
    """The status to relay for tritonserver's (status, body): 400 for a known client mistake it
    reports as 500 / 501, else `status`."""
    if status in (500, 501) and body.startswith(_CLIENT_MISTAKES):
        return 400
    return status


def parse_response_head(head: bytes) -> Tuple[int, List[Tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)]
    return status, headers


_HEX = frozenset(b"0123456789abcdefABCDEF")


class ChunkedEnd:
    """Where an HTTP/1.1 chunked body ends (RFC 9112 section 7.1: size lines, data, the zero-size
    chunk, trailer lines, an empty line), found in bytes that arrive in pieces of any size. The
    guard relays each upstream read whole as it comes (one write, one TCP segment per streamed
    event) instead of reading the framing line by line, and stops at the body's last byte."""

    def __init__(self, max_line: int = 8192):
        self.max_line = max_line
        self.skip = 0          # bytes of chunk data and its CRLF still to pass over
        self.line = b""        # a size or trailer line split across reads
        self.trailers = False  # after the zero-size chunk
        self.done = False      # the body's last byte was seen

    def feed(self, data: bytes) -> int:
        """Scan the next bytes; returns how many of them belong to the body (all of them, or up
        to its end once found). Raises ValueError on bad framing."""
        pos, n = 0, len(data)
        while pos < n and not self.done:
            if self.skip:
                k = min(self.skip, n - pos)
                pos += k
                self.skip -= k
                continue
            i = data.find(b"\n", pos)
            if i < 0:
                self.line += data[pos:]
                if len(self.line) > self.max_line:
                    raise ValueError("chunked body: a line over the limit")
                return n
            line, self.line, pos = self.line + data[pos:i + 1], b"", i + 1
            if not line.endswith(b"\r\n"):
                raise ValueError("chunked body: a line not ended by CRLF")
            if self.trailers:
                self.done = line == b"\r\n"
                continue
            size = line[:-2].split(b";", 1)[0].strip()
            if not size or not _HEX.issuperset(size):
                raise ValueError(f"chunked body: bad chunk size {size[:32]!r}")
            size = int(size, 16)
            self.trailers = size == 0
            self.skip = size + 2 if size else 0
        return pos
