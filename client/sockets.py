"""Listening sockets for the servers Tritium starts (tritonserver's ports, the HTTP guard, the OpenAI API):
bound up front, so a taken port fails at once, with its number. Low in client/: serve/ and openai/
both use it and import nothing of each other."""
from __future__ import annotations

import socket
from typing import Iterable, List, Optional, Tuple


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet); OSError if the port is taken."""
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
            bind(host, port).close()
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
def listen_socket(what: str, host: str, port: int) -> socket.socket:
    """A listening socket on host:port (held by us, so no other server can take the port)."""
    try:
        s = bind(host, port)
    except OSError as e:
        raise port_in_use_error(what, host, port, e) from None
    s.listen(1024)
    return s
