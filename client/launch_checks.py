"""What TritonServer (client/server.py) does around the tritonserver process itself: check that
the ports are free before launching, hold the public HTTP port for the HTTP guard, and give the
Python backend's shared-memory files a per-server prefix so that they can be removed afterwards."""
from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import uuid
from typing import Optional

from tritium.client.http_checks import GuardLimits

SHM_DIR = "/dev/shm"


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    # Like the servers themselves: a port in TIME_WAIT is free, one with a listener is not.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def port_in_use_error(what: str, host: str, port: int, err: OSError) -> OSError:
    return OSError(f"{what} port {port} on {host} is not available ({err.strerror or err}); another server may "
                   f"hold it: stop it or pick another port (--{what.lower()}-port N, 0 = any free port)")


def check_port_free(what: str, host: str, port: int) -> None:
    """Raise OSError naming the port if something already listens on host:port."""
    try:
        _bind(host, port).close()
    except OSError as e:
        raise port_in_use_error(what, host, port, e) from None


def listen_socket(what: str, host: str, port: int) -> socket.socket:
    """A listening socket on host:port (held by us, so no other server can take the port)."""
    try:
        s = _bind(host, port)
    except OSError as e:
        raise port_in_use_error(what, host, port, e) from None
    s.listen(1024)
    return s


def start_guard(routes, limits: Optional[GuardLimits], log_fh, security) -> subprocess.Popen:
    """Run client/http_guard.py; routes: (listening socket, upstream "HOST:PORT", check keys?)
    whose sockets the guard inherits; `security` (client/security.py) gives the keys (in the
    guard's environment) and TLS files. Returns the process."""
    cmd = [sys.executable, "-m", "tritium.client.http_guard"]
    for sock, upstream, keyed in routes:
        cmd += ["--route" if keyed else "--open-route", f"{sock.fileno()}={upstream}"]
    for name, value in (limits or GuardLimits()).__dict__.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    if security.tls:
        cmd += ["--tls-cert", security.tls_cert, "--tls-key", security.tls_key]
    return subprocess.Popen(cmd, pass_fds=[r[0].fileno() for r in routes], stdout=log_fh or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log_fh else subprocess.DEVNULL, start_new_session=True,
                            env=dict(os.environ, **security.guard_env()))


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
