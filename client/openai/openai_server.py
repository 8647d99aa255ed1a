"""An OpenAI-compatible HTTP API (FastAPI) in front of a Triton server that serves Tritium models.

    GET  /v1/models                 the served LLM models (backend `tritium`) and their LoRA adapters (with `parent`)
    GET  /v1/models/{model}
    POST /v1/completions            prompt(s) -> text; `stream: true` = server-sent events
    POST /v1/chat/completions       messages -> the engine's chat template (rendered by the backend)
    GET  /health                    200 when tritonserver answers

Every prompt becomes one Triton request over tritonclient gRPC streaming (openai_triton.py), so
in-flight batching, cancellation and metrics stay Triton's. A client that goes away (a closed
stream, or a dropped connection while a non-streamed answer is being generated) cancels its
Triton requests. Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}:
400 a bad parameter (named in `param`), 404 an unknown model or route, 413 a body over the limit,
503 Triton unreachable or the engine overloaded, 500 a bug (one line, never a traceback).
With an API key (client/security.py) every path but /health needs `Authorization: Bearer KEY`
(401 otherwise, client/openai/openai_auth.py); with certificate files it serves HTTPS, and it reaches
tritonserver's gRPC with the same keys and over TLS as well.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritium.backend.errors import from_wire
from tritium.client.openai.openai_auth import RequireApiKey
from tritium.client.openai.openai_protocol import (OpenAIError, error_from_code, max_tokens_param, parse_chat_request,
                                                   parse_completion_request)
from tritium.client.openai.openai_responses import AnswerBuilder
from tritium.client.openai.openai_triton import TritonBridge, TritonRequestError, merged

log = logging.getLogger("tritium.openai")

DEFAULT_MAX_BODY_BYTES = 16 << 20
DISCONNECT_POLL_S = 0.1
_END = object()


def _sse(d) -> bytes:
    return b"data: " + json.dumps(d, ensure_ascii=False).encode("utf-8") + b"\n\n"


async def _read_json(request, max_body_bytes: int) -> dict:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_body_bytes:
            raise OpenAIError(413, f"request body is larger than {max_body_bytes} bytes")
    try:
        d = json.loads(body.decode("utf-8"), parse_int=_parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OpenAIError(400, f"the request body must be JSON ({e})") from None
    except (RecursionError, ValueError):
        raise OpenAIError(400, "the request body must be JSON (nested too deeply or a number too large)") from None
    if not isinstance(d, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    bad_text = _lone_surrogate(d)
    if bad_text is not None:  # "\ud800" is valid JSON but no text: it cannot be encoded for Triton
        raise OpenAIError(400, f"{bad_text} holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape); "
                               "text must be valid Unicode", param=bad_text.split("[")[0].split(".")[0],
                          code="invalid_parameter")
    return d


def _parse_int(digits: str):
    """JSON integers; one too long for Python's int() (4,300 digits) becomes inf, so that the field
    check that follows names the field ("max_tokens must be ...") instead of failing the whole body."""
    return int(digits) if len(digits) <= 4000 else float("inf")


def _lone_surrogate(d) -> Optional[str]:
    """The path ("messages[0].content") of the first string or key holding a lone surrogate, else None."""
    stack = [("", d)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body"
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((f"{path}.{k}" if path else str(k), k))
                stack.append((f"{path}.{k}" if path else str(k), x))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


async def _unless_disconnected(request, aw: Awaitable):
    """Await `aw`, but cancel it (OpenAIError 499) if the HTTP client goes away meanwhile."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise OpenAIError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def create_app(triton_url: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, security=None,
               triton_tls_ca: Optional[str] = None, tool_call_parser: str = "auto"):
    """The ASGI app; `triton_url` is tritonserver's gRPC HOST:PORT. `security` (a Security):
    its API key guards this API and, with its admin key, goes to tritonserver; `triton_tls_ca`:
    reach tritonserver's gRPC over TLS, trusting this PEM file; tool_call_parser: hermes, llama3,
    mistral, or auto (from the model's chat template, client/openai/openai_tools.py)."""
    bridge = TritonBridge(triton_url, security=security, tls_ca=triton_tls_ca)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await bridge.close()

    app = FastAPI(title="Tritium OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.bridge = bridge

    def error_response(e: OpenAIError) -> JSONResponse:
        headers = {"Retry-After": "1"} if e.status == 503 else None  # overloaded: clients back off and retry
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(OpenAIError(e.status_code, msg, code=code))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, e):
        return error_response(OpenAIError(400, f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def on_bug(request, e):
        log.error("internal error on %s: %s: %s", request.url.path, type(e).__name__, e)
        return error_response(OpenAIError(500, f"internal error: {type(e).__name__}", code="internal_error"))

    @app.get("/health")
    async def health():
        await bridge.models(refresh=True)
        return {"status": "ok"}

    def model_card(name: str, created: float) -> dict:
        card = {"id": name, "object": "model", "created": int(created), "owned_by": "tritium"}
        if name in bridge.parents:  # a LoRA adapter, served by its parent LLM model
            card["parent"] = card["root"] = bridge.parents[name]
        return card

    @app.get("/v1/models")
    async def list_models():
        models = await bridge.models(refresh=True)
        return {"object": "list", "data": [model_card(n, c) for n, c in sorted(models.items())]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        await bridge.check_model(model)
        return model_card(model, (await bridge.models())[model])

    async def generate(request: Request, parsed, max_tokens_name: str):
        await bridge.check_model(parsed.model)
        builder = AnswerBuilder(parsed)
        chunks = merged([bridge.stream(parsed.model, r) for r in parsed.requests])
        kind = parsed.kind

        async def next_item():
            try:
                return await chunks.__anext__()
            except StopAsyncIteration:
                return _END
            except TritonRequestError as e:
                raise error_from_code(from_wire(str(e)), kind, max_tokens_name) from None

        if not parsed.stream:
            async def collect():
                while (item := await next_item()) is not _END:
                    builder.add(*item)
            try:
                await _unless_disconnected(request, collect())
            finally:
                await chunks.aclose()
            return JSONResponse(builder.answer())

        # Streamed: wait for the first response before the 200 goes out, so that a bad parameter
        # (found by the backend) is still a plain 400.
        try:
            first = await _unless_disconnected(request, next_item())
        except BaseException:
            await chunks.aclose()
            raise

        async def events() -> AsyncIterator[bytes]:
            try:
                for d in builder.first_chunks():
                    yield _sse(d)
                item = first
                while item is not _END:
                    builder.add(*item)
                    for d in builder.stream_chunks(*item):
                        yield _sse(d)
                    item = await next_item()
                u = builder.usage_chunk()
                if u is not None:
                    yield _sse(u)
            except OpenAIError as e:  # after the 200: the error travels as an event
                yield _sse(e.body())
            finally:
                await chunks.aclose()  # also on a client disconnect: cancels the Triton requests
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion_request(await _read_json(request, max_body_bytes))
        return await generate(request, parsed, "max_tokens")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _read_json(request, max_body_bytes)
        fmt = tool_call_parser
        if fmt == "auto":
            fmt = await bridge.tool_format(body.get("model")) if isinstance(body, dict) and body.get("tools") else "hermes"
        parsed = parse_chat_request(body, fmt)
        return await generate(request, parsed, max_tokens_param(body, "chat"))

    if security is not None and security.api_key:
        return RequireApiKey(app, security.api_key)
    return app


class OpenAIServer:
    """uvicorn serving create_app() on a socket bound up front (so a taken port fails at once,
    with its number), in this thread (run) or a background one (start / stop)."""

    def __init__(self, triton_url: str, host: str = "127.0.0.1", port: int = 9000,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "warning", security=None,
                 triton_tls_ca: Optional[str] = None, tool_call_parser: str = "auto"):
        from tritium.client.sockets import listen_socket
        self.sock = listen_socket("OpenAI", host, port)
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.triton_url = triton_url
        self.max_body_bytes = max_body_bytes
        self.log_level = log_level
        self.tool_call_parser = tool_call_parser
        self.security = security
        self.triton_tls_ca = triton_tls_ca or None
        self._server = None
        self._thread = None

    @property
    def url(self) -> str:
        scheme = "https" if self.security is not None and self.security.tls else "http"
        return f"{scheme}://{self.host}:{self.port}/v1"

    def _make(self):
        import uvicorn
        sec = self.security
        tls = dict(ssl_certfile=sec.tls_cert, ssl_keyfile=sec.tls_key) if sec is not None and sec.tls else {}
        cfg = uvicorn.Config(create_app(self.triton_url, self.max_body_bytes, sec, self.triton_tls_ca,
                                        self.tool_call_parser),
                             log_level=self.log_level, access_log=False, timeout_graceful_shutdown=5, **tls)
        self._server = uvicorn.Server(cfg)
        return self._server

    def run(self) -> None:
        """Serve until SIGINT / SIGTERM (uvicorn's handlers)."""
        self._make().run(sockets=[self.sock])

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        import threading
        server = self._make()
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]},
                                        name="tritium-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the OpenAI server did not start on {self.host}:{self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
