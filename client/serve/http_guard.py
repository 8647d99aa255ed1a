"""A small HTTP/1.1 reverse proxy in front of tritonserver's HTTP port (the checks: http_checks.py).

`tritium serve` (client/serve/server.py) binds the public HTTP and metrics ports itself, hands the
listening sockets to this process (`python -m tritium.client.serve.http_guard --route FD=HOST:PORT ...`)
and runs tritonserver's own HTTP and metrics services on free loopback ports (the metrics
service shares the HTTP frontend's crash on a large form body). Each client connection gets its own
upstream connection; a request is read whole (bounded), checked, forwarded with a
Content-Length, and the response is relayed as it arrives (chunked generate_stream events go out
one by one). A client that goes away closes its upstream connection, which is how Triton learns
to cancel the request. Rejections are answered here as {"error": "..."} like Triton's own.
On the HTTP port the guard also checks keys before reading a body (client/serve/guard_auth.py: the
admin APIs need the admin key, inference the API key when one is set); with --tls-cert /
--tls-key every route is served over TLS. The keys come in the environment, never in argv.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import sys
from typing import List, Optional, Tuple

from tritium.client.serve.generate_checks import check_generate_fields, is_generate
from tritium.client.serve.guard_auth import GuardKeys, check_access
from tritium.client.serve.http_checks import (ChunkedEnd, GuardError, GuardLimits, Request, check_body_size,
                                              check_json_depth, check_json_syntax, upstream_status, decode_body, error_response,
                                              forward_content_type, json_part, parse_content_length, parse_head,
                                              parse_response_head)

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade",
               "expect", "content-length", "content-encoding", "content-type", "host"}
HEADER_TIMEOUT_S = 30.0   # a client must send its request head within this (slow-loris)
IDLE_TIMEOUT_S = 120.0    # an idle keep-alive connection is closed after this
BODY_TIMEOUT_S = 120.0


class _StaleUpstream(Exception):
    """The upstream connection was closed before any byte of the response came back."""


class Guard:
    def __init__(self, upstream: Tuple[str, int], limits: GuardLimits, keys: Optional[GuardKeys] = None):
        self.upstream = upstream
        self.limits = limits
        self.keys = keys  # None: no key checks (the metrics port)
        self.num_connections = 0
        self.buffered_bytes = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        up: Optional[Tuple[asyncio.StreamReader, asyncio.StreamWriter]] = None
        req_target = ""
        try:
            if self.num_connections > self.limits.max_connections:
                raise GuardError(503, f"too many connections (limit {self.limits.max_connections})")
            first = True
            while True:
                req, body = await self._read_request(reader, writer, HEADER_TIMEOUT_S if first else IDLE_TIMEOUT_S)
                if req is None:
                    return
                first, req_target = False, req.target
                try:
                    fresh = up is None
                    if fresh:
                        up = await self._connect()
                    try:
                        keep = await self._forward(req, body, up, reader, writer)
                    except _StaleUpstream:
                        up[1].close()
                        up = None
                        if fresh:  # a new connection that fails at once: tritonserver is down
                            raise GuardError(502, "tritonserver closed the connection") from None
                        up = await self._connect()  # the old one had been closed while idle
                        keep = await self._forward(req, body, up, reader, writer)
                finally:
                    self.buffered_bytes -= len(body)
                if not keep:
                    return
        except GuardError as e:
            if not (e.status == 502 and req_target.startswith("/v2/health")):  # not every startup probe
                print(f"tritium-guard: {e.status} {e.message}", file=sys.stderr, flush=True)
            try:
                writer.write(error_response(e.status, e.message, e.headers))
                await writer.drain()
                await _linger(reader, writer)
            except (ConnectionError, OSError, asyncio.TimeoutError):
                pass
        except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, asyncio.CancelledError):
            pass
        finally:
            self.num_connections -= 1
            for w in ([writer] + ([up[1]] if up else [])):
                w.close()

    async def _connect(self):
        try:
            return await asyncio.open_connection(*self.upstream, limit=2 ** 20)
        except OSError:
            raise GuardError(502, "tritonserver is not reachable") from None

    async def _read_request(self, reader, writer, timeout: float):
        """(Request, checked body) or (None, b"") when the client closed between requests."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        except asyncio.IncompleteReadError as e:
            if e.partial.strip():
                raise GuardError(400, "incomplete request head") from None
            return None, b""
        except asyncio.LimitOverrunError:
            raise GuardError(431, f"request head is over {self.limits.max_header_bytes} bytes") from None
        req = parse_head(head)
        if self.keys is not None:  # before the body: an unauthorized client gets nothing buffered
            check_access(req.target, req.get, self.keys)
        te = req.get_all("transfer-encoding")
        length = parse_content_length(req.get_all("content-length"))
        if te and length is not None:
            raise GuardError(400, "both Transfer-Encoding and Content-Length")
        if te and [t.strip().lower() for t in ",".join(te).split(",")] != ["chunked"]:
            raise GuardError(400, f"Transfer-Encoding {','.join(te)!r} is not supported; use chunked or Content-Length")
        ctype = forward_content_type(req.get("content-type"))
        if length is not None:
            check_body_size(length, self.limits)
        reserved = length or 0
        self._reserve(reserved)
        try:
            if (req.get("expect") or "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await asyncio.wait_for(self._read_body(reader, length, bool(te)), BODY_TIMEOUT_S)
            body = decode_body(body, req.get("content-encoding"), self.limits)
            part = json_part(body, req.get("inference-header-content-length"))
            check_json_depth(part, self.limits)
            if ctype != "application/octet-stream":
                parsed = check_json_syntax(part)
                if parsed is not None and is_generate(req.target):
                    check_generate_fields(parsed)
        except BaseException:
            self.buffered_bytes -= reserved
            raise
        self.buffered_bytes += len(body) - reserved
        host = req.get("host") or "localhost"
        req.headers = [(k, v) for k, v in req.headers if k.lower() not in _HOP_BY_HOP]
        req.headers.append(("Host", host))
        if ctype:
            req.headers.append(("Content-Type", ctype))
        return req, body

    def _reserve(self, num_bytes: int) -> None:
        if self.buffered_bytes + num_bytes > self.limits.max_buffered_bytes:
            raise GuardError(503, "overloaded: too many request bytes in flight, retry later")
        self.buffered_bytes += num_bytes

    async def _read_body(self, reader, length: Optional[int], chunked: bool) -> bytes:
        if not chunked:
            return await reader.readexactly(length) if length else b""
        parts, total = [], 0
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise GuardError(400, "bad chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                return b"".join(parts)
            total += size
            check_body_size(total, self.limits)
            parts.append(await reader.readexactly(size))
            if await reader.readexactly(2) != b"\r\n":
                raise GuardError(400, "bad chunk framing")

    async def _forward(self, req: Request, body: bytes, up, reader, writer) -> bool:
        """Send the request upstream and relay the response; returns whether to keep the connection."""
        up_r, up_w = up
        head = f"{req.method} {req.target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in req.headers)
        if body or req.method in ("POST", "PUT"):
            head += f"Content-Length: {len(body)}\r\n"
        try:
            up_w.write(head.encode("latin-1") + b"\r\n" + body)
            await up_w.drain()
        except (ConnectionError, OSError):
            raise _StaleUpstream() from None
        relay = asyncio.ensure_future(self._relay(req, up_r, writer))
        while not relay.done():
            # A client that went away must not leave the request running upstream.
            done, _ = await asyncio.wait([relay], timeout=0.25)
            if not done and (reader.at_eof() or writer.is_closing()):
                relay.cancel()
                raise ConnectionResetError("client went away")
        return relay.result() and req.keep_alive

    async def _relay(self, req: Request, up_r, writer) -> bool:
        try:
            head = await up_r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise
            raise _StaleUpstream() from None
        except (ConnectionError, OSError):
            raise _StaleUpstream() from None
        status, headers = parse_response_head(head)
        cl = [v for k, v in headers if k == "content-length"]
        if status in (500, 501) and req.method != "HEAD" and cl and cl[0].isdigit() and int(cl[0]) <= 2 ** 16:
            body = await up_r.readexactly(int(cl[0]))
            new = upstream_status(status, body)
            if new != status:  # a client mistake tritonserver calls a server error
                head = f"HTTP/1.1 {new} Bad Request\r\n".encode() + head.split(b"\r\n", 1)[1]
            writer.write(head + body)
            await writer.drain()
            return "close" not in ",".join(v for k, v in headers if k == "connection").lower()
        writer.write(head)
        conn = ",".join(v for k, v in headers if k == "connection").lower()
        te = ",".join(v for k, v in headers if k == "transfer-encoding").lower()
        if req.method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            pass
        elif "chunked" in te:
            # Each read relayed whole as it comes (a generate_stream event is one read: one write,
            # one send to the client), the framing only scanned for the body's end.
            body_end = ChunkedEnd()
            while not body_end.done:
                data = await up_r.read(2 ** 16)
                if not data:
                    raise ConnectionResetError("tritonserver closed the connection mid-response")
                try:
                    n = body_end.feed(data)
                except ValueError as e:
                    raise ConnectionResetError(f"tritonserver: {e}") from None
                writer.write(data if n == len(data) else data[:n])
                await writer.drain()
                if n < len(data):  # bytes after the response: nothing was asked for them
                    return False
        elif cl:
            remaining = int(cl[0])
            while remaining > 0:
                data = await up_r.read(min(remaining, 2 ** 16))
                if not data:
                    raise ConnectionResetError("tritonserver closed the connection mid-response")
                writer.write(data)
                remaining -= len(data)
                await writer.drain()
        else:  # body until the upstream closes
            while True:
                data = await up_r.read(2 ** 16)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            return False
        await writer.drain()
        return "close" not in conn


async def _linger(reader, writer, max_bytes: int = 64 * 2 ** 20, timeout: float = 10.0) -> None:
    """Read and drop what the client still sends (e.g. the rest of a refused body) before closing,
    so that it reads our error response instead of a connection reset."""
    if writer.can_write_eof():
        writer.write_eof()

    async def drain():
        n = 0
        while n < max_bytes:
            data = await reader.read(2 ** 16)
            if not data:
                return
            n += len(data)
    await asyncio.wait_for(drain(), timeout)


async def serve(routes: List[Tuple[socket.socket, Tuple[str, int], Optional[GuardKeys]]], limits: GuardLimits,
                ssl_context: Optional[ssl.SSLContext] = None) -> None:
    """Serve each (listening socket, upstream address, keys) route until the parent process is gone."""
    servers = []
    for sock, upstream, keys in routes:
        servers.append(await asyncio.start_server(Guard(upstream, limits, keys).handle, sock=sock,
                                                  limit=limits.max_header_bytes, ssl=ssl_context))
    parent = os.getppid()
    while os.getppid() == parent:  # the parent (tritium serve) is gone: so is the guard
        await asyncio.sleep(1.0)
    for server in servers:
        server.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tritium.client.serve.http_guard", description=__doc__.splitlines()[0])
    p.add_argument("--route", action="append", default=[],
                   help="FD=HOST:PORT (an inherited listening socket) or LISTEN_HOST:PORT=HOST:PORT: "
                        "guard HOST:PORT from there, checking keys ($TRITIUM_GUARD_ADMIN_KEY, "
                        "$TRITIUM_GUARD_API_KEY); repeat for more ports")
    p.add_argument("--open-route", action="append", default=[],
                   help="the same, without key checks (the metrics port)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve every route over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    for f, v in GuardLimits().__dict__.items():
        p.add_argument("--" + f.replace("_", "-"), type=int, default=v)
    args = p.parse_args(argv)
    if not args.route and not args.open_route:
        p.error("give at least one --route or --open-route")
    limits = GuardLimits(**{f: getattr(args, f) for f in GuardLimits().__dict__})
    keys = GuardKeys.from_env()
    if args.route and keys is None:
        print("tritium-guard: --route needs $TRITIUM_GUARD_ADMIN_KEY (use --open-route for a route without "
              "key checks)", file=sys.stderr)
        return 2
    ssl_context = None
    if args.tls_cert or args.tls_key:
        from tritium.client.security import server_ssl_context
        try:
            ssl_context = server_ssl_context(args.tls_cert, args.tls_key)
        except (TypeError, ValueError) as e:
            print(f"tritium-guard: {e}", file=sys.stderr)
            return 2
    routes = []
    for r, route_keys in [(r, keys) for r in args.route] + [(r, None) for r in args.open_route]:
        front, _, upstream = r.partition("=")
        host, _, port = upstream.rpartition(":")
        if front.isdigit():
            sock = socket.socket(fileno=int(front))
        else:  # HOST:PORT to bind here (standalone use, e.g. docker/entrypoint.sh)
            from tritium.client.sockets import listen_socket
            fhost, _, fport = front.rpartition(":")
            try:
                sock = listen_socket("guard", fhost, int(fport))
            except OSError as e:
                print(f"tritium-guard: {e}", file=sys.stderr)
                return 2
        routes.append((sock, (host, int(port)), route_keys))
    try:
        asyncio.run(serve(routes, limits, ssl_context))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
