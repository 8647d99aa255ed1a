"""The OpenAI API's key check: an ASGI middleware in front of the FastAPI app.

Every path but /health needs `Authorization: Bearer <--api-key>` (compared in constant time);
otherwise 401 with OpenAI's error body and `WWW-Authenticate: Bearer`, before the body is read
or anything reaches Triton. /health stays open for load balancers and Kubernetes probes: it says
only whether tritonserver answers. A plain ASGI middleware (not Starlette's BaseHTTPMiddleware),
so streamed answers and client-disconnect detection pass through untouched.
"""
from __future__ import annotations

import json

from tritium.client.security import API_KEY_ENV, bearer_token, keys_match

OPEN_PATHS = ("/health",)


def _error(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class RequireApiKey:
    """ASGI middleware: 401 unless the request carries the API key (paths in OPEN_PATHS excepted)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = None
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                header = v.decode("latin-1")
        if keys_match(bearer_token(header), self.api_key):
            return await self.app(scope, receive, send)
        if header is None:
            body = _error("You didn't provide an API key: send 'Authorization: Bearer KEY' with the key the server "
                          f"was started with (--api-key / ${API_KEY_ENV}).", "missing_api_key")
        else:
            body = _error("Incorrect API key provided.", "invalid_api_key")
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="tritium"')]})
        await send({"type": "http.response.body", "body": body})
