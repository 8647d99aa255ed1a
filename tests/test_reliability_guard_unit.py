"""The HTTP guard's request checks (client/serve/http_checks.py) and its request-head parser, no sockets."""
from __future__ import annotations

import gzip
import json
import zlib

import pytest

from tritium.client.serve.http_checks import (GuardError, GuardLimits, check_body_size, check_json_depth, decode_body,
                                              forward_content_type, json_depth, json_part, parse_content_length)
from tritium.client.serve.http_checks import parse_head

LIMITS = GuardLimits()


def _nested(depth: int) -> bytes:
    return ('{"text_input":"Hello","max_tokens":2,"x":' + "[" * depth + "]" * depth + "}").encode()


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": [[]]}]}') == 5
    assert json_depth(json.dumps({"text_input": "[[[[[{{{{" * 100, "x": [1]}).encode()) == 2
    # escaped quotes inside a string do not end it
    assert json_depth(json.dumps({"s": 'he said \\"[[[[\\" ok', "y": {"z": 1}}).encode()) == 2
    assert json_depth(b"") == 0 and json_depth(b"3") == 0


@pytest.mark.parametrize("depth", [LIMITS.max_json_depth - 1, LIMITS.max_json_depth])
def test_depth_at_the_limit_passes(depth):
    check_json_depth(_nested(depth - 1), LIMITS)  # the outer object is one more level


def test_depth_over_the_limit_names_the_limit():
    for depth in (LIMITS.max_json_depth, 200_000):
        with pytest.raises(GuardError) as e:
            check_json_depth(_nested(depth), LIMITS)
        assert e.value.status == 400 and "max-json-depth" in e.value.message and str(LIMITS.max_json_depth) in \
            e.value.message


def test_many_brackets_inside_strings_are_not_nesting():
    body = json.dumps({"text_input": "[" * 500_000, "max_tokens": 2}).encode()
    check_json_depth(body, LIMITS)


def test_content_types():
    assert forward_content_type(None) is None
    assert forward_content_type("application/json; charset=utf-8") == "application/json"
    assert forward_content_type("application/octet-stream") == "application/octet-stream"
    # what curl -d and urllib send: forwarded as JSON, never as a form that 2.51 parses
    assert forward_content_type("application/x-www-form-urlencoded") == "application/json"
    assert forward_content_type("Application/X-WWW-Form-Urlencoded;charset=UTF-8") == "application/json"
    assert forward_content_type("text/plain") == "application/json"
    for bad in ("multipart/form-data; boundary=x", "image/png"):
        with pytest.raises(GuardError) as e:
            forward_content_type(bad)
        assert e.value.status == 415 and "application/json" in e.value.message


def test_body_size_and_content_length():
    check_body_size(LIMITS.max_body_bytes, LIMITS)
    with pytest.raises(GuardError) as e:
        check_body_size(LIMITS.max_body_bytes + 1, LIMITS)
    assert e.value.status == 413 and "max-body-bytes" in e.value.message
    assert parse_content_length([]) is None and parse_content_length(["12"]) == 12
    for bad in (["-1"], ["1e3"], ["3", "4"], [" "]):
        with pytest.raises(GuardError):
            parse_content_length(bad)


def test_decode_body_gzip_deflate_and_bombs():
    raw = json.dumps({"text_input": "hi", "max_tokens": 3}).encode()
    assert decode_body(gzip.compress(raw), "gzip", LIMITS) == raw
    assert decode_body(zlib.compress(raw), "deflate", LIMITS) == raw
    assert decode_body(raw, None, LIMITS) == raw
    bomb = gzip.compress(b" " * (LIMITS.max_body_bytes + 10))
    assert len(bomb) < 10_000
    with pytest.raises(GuardError) as e:
        decode_body(bomb, "gzip", LIMITS)
    assert e.value.status == 413
    with pytest.raises(GuardError) as e:
        decode_body(b"not gzip", "gzip", LIMITS)
    assert e.value.status == 400
    with pytest.raises(GuardError) as e:
        decode_body(raw, "br", LIMITS)
    assert e.value.status == 415


def test_json_part_of_binary_requests():
    assert json_part(b'{"a":1}XYZ', "7") == b'{"a":1}'
    assert json_part(b'{"a":1}', None) == b'{"a":1}'
    for bad in ("8", "x", "-1"):
        with pytest.raises(GuardError):
            json_part(b'{"a":1}', bad)


def test_parse_head():
    req = parse_head(b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nConnection: close\r\n\r\n")
    assert (req.method, req.target, req.get("content-length"), req.keep_alive) == \
        ("POST", "/v2/models/m/generate", "5", False)
    assert parse_head(b"GET / HTTP/1.1\r\n\r\n").keep_alive
    assert not parse_head(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    for bad in (b"GET http://evil/ HTTP/1.1\r\n\r\n", b"GET / HTTP/2\r\n\r\n", b"GET / HTTP/1.1\r\nNoColon\r\n\r\n",
                b"GET / HTTP/1.1\r\n folded: x\r\n\r\n", b"GARBAGE\r\n\r\n"):
        with pytest.raises(GuardError) as e:
            parse_head(bad)
        assert e.value.status == 400


def _guard(route: str):
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITIUM_GUARD_ADMIN_KEY="x" * 32)  # a keyed --route needs the admin key
    return subprocess.Popen([sys.executable, "-m", "tritium.client.serve.http_guard", "--route", route],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_standalone_guard_answers_for_a_missing_upstream_and_refuses_a_taken_port():
    import http.client
    import socket
    import time
    from tritium.client.serve.server import free_port
    port = free_port()
    proc = _guard(f"127.0.0.1:{port}=127.0.0.1:1")  # nothing listens on port 1
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "the guard did not start"
                time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v2/models/m/generate", body=b'{"text_input": "hi"}')
        r = conn.getresponse()
        assert r.status == 502 and "not reachable" in json.loads(r.read())["error"]
        conn.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/v2/health/ready", headers={"X-Big": "a" * (LIMITS.max_header_bytes + 10)})
        assert conn.getresponse().status == 431
        conn.close()
        taken = _guard(f"127.0.0.1:{port}=127.0.0.1:1")  # a second guard on the same port: port named, exit 2
        out, _ = taken.communicate(timeout=60)
        assert taken.returncode == 2 and f"port {port} on 127.0.0.1 is not available" in out, out
    finally:
        proc.terminate()
        proc.wait(10)


def _chunked(pieces, trailers=(), ext=False) -> bytes:
    """A chunked body written out by hand (RFC 9112 section 7.1)."""
    out = b"".join(b"%x%s\r\n%s\r\n" % (len(p), b";x=1" if ext else b"", p) for p in pieces)
    return out + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


@pytest.mark.parametrize("seed", range(6))
def test_chunked_end_found_in_any_split(seed):
    """The guard relays a streamed response read by read; ChunkedEnd finds the body's last byte
    wherever the reads split it (inside a size line, the data, a CRLF, the trailers), and nothing
    after it counts."""
    import random
    from tritium.client.serve.http_checks import ChunkedEnd
    rng = random.Random(seed)
    pieces = [bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 13, 300, 70000]))) for _ in range(rng.randint(0, 6))]
    body = _chunked(pieces, trailers=[b"X-T: 1"] * (seed % 2), ext=seed % 3 == 0)
    data = body + b"HTTP/1.1 200 OK\r\n" * (seed % 2)  # bytes past the end are not the body's
    for _ in range(20):
        scan, pos, relayed = ChunkedEnd(), 0, 0
        while pos < len(data) and not scan.done:
            step = rng.choice([1, 2, 3, 7, 64, 5000, 100000])
            n = scan.feed(data[pos:pos + step])
            relayed += n
            pos += step
        assert scan.done and relayed == len(body)


def test_chunked_end_refuses_bad_framing():
    from tritium.client.serve.http_checks import ChunkedEnd
    for bad in (b"-5\r\nabc\r\n", b"zz\r\n", b"\r\n", b"5\nhello\r\n", b"0x5\r\nhello\r\n", b"1_0\r\n"):
        with pytest.raises(ValueError, match="chunked body"):
            ChunkedEnd().feed(bad)
    with pytest.raises(ValueError, match="over the limit"):
        ChunkedEnd(max_line=16).feed(b"1" * 40)
    scan = ChunkedEnd()
    assert scan.feed(b"5\r\nhel") == 6 and not scan.done  # a partial body: all of it relayed, not done
