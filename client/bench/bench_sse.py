"""The serving benchmark's server-sent-events client, shared by its HTTP drivers (OpenAI
/v1/completions: bench_openai.py; Triton's generate_stream: bench_triton_http.py), so both
systems of a comparison are read by the same lean code: one keep-alive http.client connection per
benchmark worker, one readline and one json.loads per event, the event timed when its line
arrives.

A driver gives the session the request body (`body(req)`) and its `headers` (HEADERS and, for a
server with an API key, `Authorization: Bearer KEY`), and reads each decoded event into the
RequestResult (`on_event(res, t, event)`: False ends the request); `finish(res)` settles the
counts once the stream has ended.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Iterator, Tuple

from tritium.client.bench.bench_drivers import RequestResult, now
from tritium.client.bench.bench_workload import BenchRequest

HEADERS = {"Content-Type": "application/json", "Accept": "text/event-stream"}


def sse_data(resp) -> Iterator[Tuple[float, bytes]]:
    """(arrival time, payload) of each `data:` line of a server-sent-events body, until the body
    ends or a `data: [DONE]` line (the OpenAI closing marker)."""
    readline = resp.readline
    while True:
        line = readline()
        if not line:
            return
        t = now()
        if not line.startswith(b"data:"):
            continue  # the blank line between events, comments, other fields
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield t, data


class SSESession:
    """One benchmark worker's keep-alive connection to `drv.url`, its requests one at a time."""

    def __init__(self, drv):
        self.drv = drv
        u = urllib.parse.urlsplit(drv.url)
        self.path = u.path
        self.conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self.netloc = u.netloc
        self.conn = None

    def _post(self, body: bytes):
        for attempt in (0, 1):  # a keep-alive connection the server closed: reconnect once
            if self.conn is None:
                self.conn = self.conn_cls(self.netloc, timeout=self.drv.timeout)
            try:
                self.conn.request("POST", self.path, body=body, headers=getattr(self.drv, "headers", HEADERS))
                return self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise

    def run(self, req: BenchRequest, request_id: str) -> RequestResult:
        body = json.dumps(self.drv.body(req, request_id)).encode("utf-8")
        res = RequestResult(req.index, req.max_tokens, now())
        try:
            resp = self._post(body)
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {error_text(resp.read())[:300]}"
            else:
                on_event = self.drv.on_event
                for t, data in sse_data(resp):
                    if not on_event(res, t, json.loads(data)):
                        break
                resp.read()  # drain so the keep-alive connection can carry the next request
                self.drv.finish(res)
            res.t_end = now()
        except Exception as e:  # count it and go on with a fresh connection
            res.error, res.t_end = f"{type(e).__name__}: {e}", now()
            if self.conn is not None:
                self.conn.close()
                self.conn = None
        return res

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


def key_refused(status: int, flag: str, url: str, body: bytes) -> ValueError:
    """The error of a server that refuses the benchmark's API key (HTTP 401 / 403), naming the flag."""
    return ValueError(f"{flag}: the server at {url} refused the request (HTTP {status}: {error_text(body)[:200]}); "
                      f"give its API key with --api-key KEY or $TRITIUM_API_KEY")


def with_key(api_key, protocol: str = "http") -> dict:
    """HEADERS plus the header carrying `api_key` (client/security.py; {} of it without a key)."""
    from tritium.client.security import key_headers
    return dict(HEADERS, **key_headers(api_key, protocol))


def error_text(raw: bytes) -> str:
    """The message of an error body: its JSON "error" field (a string, or an object's "message"),
    else the body's text."""
    text = raw.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return text
    if isinstance(err, dict):
        return str(err.get("message", err))
    return text if err is None else str(err)
