"""Listening sockets for the servers Tritium starts (tritonserver's ports, the HTTP guard, the OpenAI API):
bound up front, so a taken port fails at once, with its number. Low in client/: serve/ and openai/
both use it and import nothing of each other."""
from __future__ import annotations

import socket


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


def check_port_free(what: str, host: str, port: int) -> None:
    """Raise OSError naming the port if something already listens on host:port."""
    try:
        bind(host, port).close()
    except OSError as e:
        raise port_in_use_error(what, host, port, e) from None


def listen_socket(what: str, host: str, port: int) -> socket.socket:
    """A listening socket on host:port (held by us, so no other server can take the port)."""
    try:
        s = bind(host, port)
    except OSError as e:
        raise port_in_use_error(what, host, port, e) from None
    s.listen(1024)
    return s
