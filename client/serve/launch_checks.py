"""What TritonServer (client/serve/server.py) does around the tritonserver process itself: start the
HTTP guard on the public ports it holds (the sockets: client/sockets.py, which also checks that
the ports are free, all of them at once), name each server's log file after its HTTP port, and
give the Python backend's shared-memory files a per-server prefix so that they can be removed
afterwards."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import uuid
from typing import Optional

from tritium.client.serve.http_checks import GuardLimits

SHM_DIR = "/dev/shm"


def start_guard(routes, limits: Optional[GuardLimits], log_fh, security) -> subprocess.Popen:
    """Run client/serve/http_guard.py; routes: (listening socket, upstream "HOST:PORT", check keys?)
    whose sockets the guard inherits; `security` (client/security.py) gives the keys (in the
    guard's environment) and TLS files. Returns the process."""
    cmd = [sys.executable, "-m", "tritium.client.serve.http_guard"]
    for sock, upstream, keyed in routes:
        cmd += ["--route" if keyed else "--open-route", f"{sock.fileno()}={upstream}"]
    for name, value in (limits or GuardLimits()).__dict__.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    if security.tls:
        cmd += ["--tls-cert", security.tls_cert, "--tls-key", security.tls_key]
    return subprocess.Popen(cmd, pass_fds=[r[0].fileno() for r in routes], stdout=log_fh or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log_fh else subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, **security.guard_env()))


def default_log_file(cache: str, http_port: int) -> str:
    """<cache>/logs/tritonserver-<HTTP port>.log: each running server has its own log (no two
    servers hold one HTTP port), and a restart on the same port replaces its own old log."""
    d = os.path.join(cache, "logs")
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"tritonserver-{http_port}.log")


def new_shm_prefix() -> str:
    """A shared-memory name prefix owned by one server (the Python backend appends a uuid)."""
    return f"tritium_{os.getpid()}_{uuid.uuid4().hex[:8]}_"


def shm_backend_args(prefix: str, backends=("python", "tritium")) -> list:
    return [f"--backend-config={b},shm-region-prefix-name={prefix}" for b in backends]


def remove_shm_files(prefix: str) -> int:
    """Delete the shared-memory files a stopped server left behind; returns how many."""
    n = 0
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n
