"""The HTTP guard's key checks: which Triton API a request path belongs to, and whether the
request carries the key that API needs (the groups and headers: client/security.py).

The paths follow tritonserver 2.51's HTTP routes (KServe v2 plus Triton's extensions); a path
that is none of them is answered 404 here and never forwarded, so a spelling that the guard does
not know cannot slip an admin call past it. tritonserver checks the same headers again itself.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Optional

from tritium.client.serve.http_checks import GuardError
from tritium.client.security import (ADMIN_APIS, ADMIN_HEADER, ADMIN_KEY_ENV, API_KEY_ENV, OPEN_APIS, bearer_token,
                                     keys_match)

_NAME = r"[^/]+"
_MODEL = re.compile(rf"/v2/models/({_NAME})(?:/versions/[0-9]+)?(?:/(infer|generate|generate_stream|ready|config|"
                    rf"stats|trace/setting))?")
_MODEL_ACTION_API = {None: "metadata", "infer": "inference", "generate": "inference", "generate_stream": "inference",
                     "ready": "health", "config": "model-config", "stats": "statistics", "trace/setting": "trace"}
# Whole subtrees: anything under them is that API, whatever tritonserver makes of the rest.
_PREFIX_API = (("/v2/repository", "model-repository"), ("/v2/systemsharedmemory", "shared-memory"),
               ("/v2/cudasharedmemory", "shared-memory"), ("/v2/trace", "trace"), ("/v2/logging", "logging"))


def api_of(target: str) -> Optional[str]:
    """The Triton API group of a request target ("/v2/models/m/infer?x" -> "inference"); None if
    the path is not one of tritonserver's routes."""
    path = target.split("?", 1)[0].split("#", 1)[0]
    for prefix, api in _PREFIX_API:
        if path == prefix or path.startswith(prefix + "/"):
            return api
    if path in ("/v2/health/live", "/v2/health/ready"):
        return "health"
    if path == "/v2":
        return "metadata"
    if path == "/v2/models/stats":
        return "statistics"
    m = _MODEL.fullmatch(path)
    if m:
        return _MODEL_ACTION_API[m.group(2)]
    return None


@dataclass(frozen=True)
class GuardKeys:
    """The keys the guard enforces on one route (the HTTP port; the metrics port has none)."""
    admin_key: str
    admin_configured: bool       # False: the admin key is the server's own random one
    api_key: Optional[str] = None

    @classmethod
    def from_env(cls, env=None) -> Optional["GuardKeys"]:
        env = os.environ if env is None else env
        admin = env.get("TRITIUM_GUARD_ADMIN_KEY")
        if not admin:
            return None
        return cls(admin_key=admin, admin_configured=env.get("TRITIUM_GUARD_ADMIN_CONFIGURED") == "1",
                   api_key=env.get("TRITIUM_GUARD_API_KEY") or None)


def check_access(target: str, header: Callable[[str], Optional[str]], keys: GuardKeys) -> None:
    """Raise GuardError (404 unknown path, 403 admin API without the admin key, 401 no or wrong
    API key) unless the request may go on; `header(name)` reads a request header."""
    api = api_of(target)
    if api is None:
        raise GuardError(404, f"no such API: {target.split('?', 1)[0][:200]!r} is not a Triton HTTP route")
    if api in OPEN_APIS:
        return
    if api in ADMIN_APIS:
        if keys_match(header(ADMIN_HEADER), keys.admin_key):
            return
        if not keys.admin_configured:
            raise GuardError(403, f"the {api} API is disabled on this port (it can change what the server runs "
                                  f"or reads); start the server with --admin-key or ${ADMIN_KEY_ENV} and send "
                                  f"header '{ADMIN_HEADER}: KEY'")
        raise GuardError(403, f"the {api} API needs the admin key in header '{ADMIN_HEADER}'")
    if keys.api_key is not None and not keys_match(bearer_token(header("authorization")), keys.api_key):
        given = "a wrong" if header("authorization") else "no"
        raise GuardError(401, f"{given} API key for the {api} API: send 'Authorization: Bearer KEY' with the key "
                              f"the server was started with (--api-key / ${API_KEY_ENV})",
                         headers=(("WWW-Authenticate", 'Bearer realm="tritium"'),))
