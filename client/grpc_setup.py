"""gRPC settings of Tritium's own client processes (the `tritium` command, the benchmarks).

grpcio >= 1.6x runs a client channel's I/O on its EventEngine: a pool of C++ threads reads each
message and hands it to the Python thread that polls the completion queue, one more thread
wake-up per streamed response. With the EventEngine client off (`GRPC_EXPERIMENTS=
-event_engine_client,-event_engine_for_all_other_endpoints`), the polling thread reads the socket
itself: a streamed token cost the client 0.41-0.43 ms of CPU instead of 0.52-0.54 here
(docs/serving.md#per-token-work-beside-the-step). grpc reads the variable once, when it is first
imported, so `apply()` must run before anything imports grpc (tritonclient.grpc does).

A user's own GRPC_EXPERIMENTS wins; TRITIUM_GRPC_EVENT_ENGINE=1 keeps grpc's default. The
variable is taken out of the environment of the tritonserver this process starts (its own grpc
has other experiments): `server_environment(env)`.
"""
from __future__ import annotations

import os
import sys
from typing import Dict

ENV = "GRPC_EXPERIMENTS"
KEEP_ENV = "TRITIUM_GRPC_EVENT_ENGINE"
CLIENT_EXPERIMENTS = "-event_engine_client,-event_engine_for_all_other_endpoints"

_applied = False


def apply() -> bool:
    """Turn grpc's EventEngine client off for this process, unless grpc is already imported (too
    late), the user set GRPC_EXPERIMENTS, or TRITIUM_GRPC_EVENT_ENGINE is 1. True when it did."""
    global _applied
    keep = os.environ.get(KEEP_ENV, "0").strip()
    if keep not in ("0", "1"):
        raise ValueError(f"{KEEP_ENV} must be 0 or 1, got {keep!r}")
    if keep == "1" or ENV in os.environ or "grpc" in sys.modules:
        return _applied
    os.environ[ENV] = CLIENT_EXPERIMENTS
    _applied = True
    return True


def server_environment(env: Dict[str, str]) -> Dict[str, str]:
    """`env` for a tritonserver child: without the GRPC_EXPERIMENTS that apply() set."""
    if _applied and env.get(ENV) == CLIENT_EXPERIMENTS:
        env = dict(env)
        del env[ENV]
    return env
