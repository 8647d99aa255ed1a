"""What TritonServer (client/server.py) does around the tritonserver process itself: check that
the ports are free before launching (all of them at once, so one message names every taken
port), hold the public HTTP port for the HTTP guard, name each server's log file after its HTTP
port, and give the Python backend's shared-memory files a per-server prefix so that they can be
removed afterwards."""
from __future__ import annotations

import glob
import os
import socket
import subprocess
import sys
import uuid
from typing import Iterable, List, Optional, Tuple

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


# The user's flag for each public port (internal ports, picked by us, have none).
PORT_FLAGS = {"HTTP": "--http-port", "gRPC": "--grpc-port", "metrics": "--metrics-port", "OpenAI": "--openai-port"}


def taken_ports(host: str, ports: Iterable[Tuple[str, Optional[int]]]) -> List[Tuple[str, int, str]]:
    """(what, port, reason) for each (what, port) that something already listens on; ports of
    None or 0 (any free port) are skipped."""
    taken = []
    for what, port in ports:
        if not port:
            continue
        try:
            _bind(host, port).close()
        except OSError as e:
            taken.append((what, port, e.strerror or str(e)))
    return taken


def check_ports_free(host: str, ports: Iterable[Tuple[str, Optional[int]]]) -> None:
    """Raise one OSError naming every taken port of `ports` ((what, port) pairs; what is "HTTP",
    "gRPC", "metrics", "OpenAI" or a description of an internal port), and ValueError if two
    of them are the same port. Nothing is started or written before this passes."""
    ports = [(w, p) for w, p in ports if p]
    seen: dict = {}
    for what, port in ports:
        if port in seen:
            raise ValueError(f"{PORT_FLAGS.get(seen[port], seen[port])} and {PORT_FLAGS.get(what, what)} are both "
                             f"{port}: each service needs its own port")
        seen[port] = what
    taken = taken_ports(host, ports)
    if not taken:
        return
    names = [f"{what} port {port}" for what, port, _ in taken]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    flags = [f"{PORT_FLAGS[what]} N" for what, _, _ in taken if what in PORT_FLAGS]
    advice = (f"stop it or pick {'another port' if len(flags) == 1 else 'other ports'} "
              f"({', '.join(flags)}; 0 = any free port)" if flags else "")
    if len(flags) < len(taken):  # an internal port we picked was taken since: picking again helps
        advice += ("; " if advice else "") + "start again to pick new internal ports"
    raise OSError(f"{listed} on {host} {'is' if len(taken) == 1 else 'are'} not available ({taken[0][2]}); "
                  f"another server may hold {'it' if len(taken) == 1 else 'them'}: {advice}")


def default_log_file(cache: str, http_port: int) -> str:
    """<cache>/logs/tritonserver-<HTTP port>.log: each running server has its own log (no two
    servers hold one HTTP port), and a restart on the same port replaces its own old log."""
    d = os.path.join(cache, "logs")
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"tritonserver-{http_port}.log")


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
