"""Start the real tritonserver from the nvidia-pytriton wheel with the `tritium` backend installed.

The wheel ships `pytriton/tritonserver/bin/tritonserver` (2.51), the Python backend and one
backend stub per Python version. A backend directory is assembled once per Python version in the
Tritium cache:

    backends/python/   libtriton_python.so + triton_python_backend_utils.py + the stub for this
                       Python (copies: Triton refuses a backend library that is a symlink leading
                       outside the backend directory)
    backends/tritium/  model.py = tritium/backend/triton_backend/model.py (refreshed on every start), which makes
                       `backend: "tritium"` a Python-based backend

The server runs with this interpreter's bin/ first on PATH (the stub imports numpy and tritium
from the Python it finds there) and with the wheel's nvidia_pytriton.libs on LD_LIBRARY_PATH.
By default the public HTTP port is served by the HTTP guard (client/serve/http_guard.py), which
keeps single requests that crash tritonserver 2.51's HTTP frontend away from it; tritonserver's
own HTTP service then listens on a free loopback port (`triton_http_url`).
Secure by default (client/security.py, docs/security.md): tritonserver runs with its
model-repository, model-config, shared-memory, trace and logging APIs restricted to an admin key
(a random one unless `Security(admin_key=...)` is given), inference to the API key if one is set,
and gRPC over TLS when certificate files are given; the guard checks the same keys and serves TLS.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import List, Optional

from tritium.client import grpc_setup
from tritium.client.serve.http_checks import GuardLimits
from tritium.client.serve.launch_checks import new_shm_prefix, remove_shm_files, shm_backend_args, start_guard
from tritium.client.security import Security, local_client_ssl_context
from tritium.client.sockets import check_ports_free, listen_socket

# tritonserver's own grace period for unloading models on SIGINT. Unloading takes ~1.5 s here,
# more on a busy machine: 5 s made a clean stop exit with code 1 under load. Below stop_timeout.
EXIT_TIMEOUT_S = 15


def _site_root() -> str:
    import pytriton  # nvidia-pytriton
    return os.path.dirname(os.path.dirname(os.path.abspath(pytriton.__file__)))


def wheel_paths() -> dict:
    """Paths inside the nvidia-pytriton wheel: binary, python backend, stub, shared libraries."""
    try:
        site = _site_root()
    except ImportError:
        raise OSError("nvidia-pytriton is not installed; `pip install nvidia-pytriton` (it carries tritonserver)") \
            from None
    root = os.path.join(site, "pytriton", "tritonserver")
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    paths = {
        "binary": os.path.join(root, "bin", "tritonserver"),
        "python_backend": os.path.join(root, "backends", "python"),
        "stub": os.path.join(root, "python_backend_stubs", ver, "triton_python_backend_stub"),
        "libs": os.path.join(site, "nvidia_pytriton.libs"),
    }
    for key in ("binary", "python_backend", "stub"):
        if not os.path.exists(paths[key]):
            raise OSError(f"nvidia-pytriton wheel has no {paths[key]} (Python {ver} unsupported?)")
    return paths


def cache_dir() -> str:
    d = os.environ.get("TRITIUM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tritium")
    os.makedirs(d, exist_ok=True)
    return d


def _copy_if_changed(src: str, dst: str) -> None:
    if os.path.exists(dst) and os.path.getsize(dst) == os.path.getsize(src) \
            and os.path.getmtime(dst) >= os.path.getmtime(src):
        return
    tmp = dst + ".tmp"
    shutil.copy2(src, tmp)
    os.replace(tmp, dst)  # atomic: concurrent starts never see half a file


def prepare_backend_dir(dest: Optional[str] = None) -> str:
    """Assemble (or refresh) a Triton backend directory holding `python` and `tritium`; returns it."""
    w = wheel_paths()
    dest = dest or os.path.join(cache_dir(), "backends", f"py{sys.version_info.major}{sys.version_info.minor}")
    py = os.path.join(dest, "python")
    os.makedirs(py, exist_ok=True)
    for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
        _copy_if_changed(os.path.join(w["python_backend"], f), os.path.join(py, f))
    _copy_if_changed(w["stub"], os.path.join(py, "triton_python_backend_stub"))
    tri = os.path.join(dest, "tritium")
    os.makedirs(tri, exist_ok=True)
    return dest


def backend_model_source() -> str:
    """Path of tritium/backend/triton_backend/model.py in the installed package."""
    import importlib.util
    spec = importlib.util.find_spec("tritium.backend.triton_backend")
    return os.path.join(list(spec.submodule_search_locations)[0], "model.py")


def install_tritium_backend(backend_dir: str) -> str:
    """Copy the backend's model.py to <backend_dir>/tritium/model.py; returns the path."""
    dst_dir = os.path.join(backend_dir, "tritium")
    os.makedirs(dst_dir, exist_ok=True)
    dst = os.path.join(dst_dir, "model.py")
    shutil.copyfile(backend_model_source(), dst + ".tmp")
    os.replace(dst + ".tmp", dst)
    return dst


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PortPicker:
    """Distinct free ports for the services of one server. Each socket stays bound until close(),
    so the kernel cannot hand the same port out twice (free_port called twice in a row can return
    one port for both, and two services would then ask for it); `taken` ports are never returned."""

    def __init__(self, taken=()):
        self.taken = {p for p in taken if p}
        self._socks: List[socket.socket] = []

    def pick(self, host: str = "127.0.0.1") -> int:
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._socks.append(s)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in self.taken:
                self.taken.add(port)
                return port

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()


def server_env() -> dict:
    """Environment for tritonserver: this Python first on PATH, the wheel's libs on LD_LIBRARY_PATH,
    OMP_WAIT_POLICY=PASSIVE unless set."""
    env = grpc_setup.server_environment(dict(os.environ))
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    libs = wheel_paths()["libs"]
    env["LD_LIBRARY_PATH"] = libs + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    # The engines' OpenMP threads sleep when idle instead of spinning (see client/cli/main.py).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def stop_process_group(proc: subprocess.Popen, timeout: float) -> int:
    """SIGINT the process group led by `proc`, wait up to `timeout` s, then SIGKILL what is left
    (children a crash or a timeout left behind); returns proc's exit code."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


class TritonServer:
    """A tritonserver child process on chosen (or free) ports.

    with TritonServer(repo) as srv: ... srv.http_url / srv.grpc_url / srv.metrics_url
    Models load at start (explicit model control, --load-model=*); load/unload via the
    repository API needs the admin key (`headers("grpc", admin=True)`); `security` (client/
    security.py) sets the keys and TLS, secure by default. stop() sends SIGINT, then SIGKILL to
    the process group after `stop_timeout` seconds, so no stub survives, and removes the server's shared-memory files.
    start() raises OSError naming the port if one is taken. http_guard False exposes
    tritonserver's HTTP port directly (for comparisons only: a single request can crash it).
    """

    def __init__(self, repo: str, http_port: Optional[int] = None, grpc_port: Optional[int] = None,
                 metrics_port: Optional[int] = None, host: str = "127.0.0.1", log_file: Optional[str] = None,
                 backend_dir: Optional[str] = None, load_models: Optional[List[str]] = None,
                 exit_on_error: bool = True, extra_args: Optional[List[str]] = None, log_verbose: int = 0,
                 stop_timeout: float = 20.0, http_guard: bool = True, guard_limits: Optional[GuardLimits] = None,
                 security: Optional[Security] = None):
        if not os.path.isdir(repo):
            raise FileNotFoundError(f"--repo {repo}: not a directory")
        self.repo = os.path.abspath(repo)
        self.host = host
        ports = PortPicker(taken=(http_port, grpc_port, metrics_port))
        self.http_port = http_port or ports.pick(host)
        self.grpc_port = grpc_port or ports.pick(host)
        self.metrics_port = metrics_port or ports.pick(host)
        self.log_file = log_file
        self.backend_dir = backend_dir
        self.load_models = load_models if load_models is not None else ["*"]
        self.exit_on_error = exit_on_error
        self.extra_args = list(extra_args or [])
        self.log_verbose = log_verbose
        self.stop_timeout = stop_timeout
        self.http_guard = http_guard
        self.guard_limits = guard_limits
        self.security = security or Security()
        # With the guard, tritonserver's HTTP and metrics services listen here (loopback only) instead.
        self.triton_http_port = ports.pick("127.0.0.1") if http_guard else self.http_port
        self.triton_metrics_port = ports.pick("127.0.0.1") if http_guard else self.metrics_port
        ports.close()
        self.shm_prefix = new_shm_prefix()
        self.proc: Optional[subprocess.Popen] = None
        self.guard_proc: Optional[subprocess.Popen] = None
        self._log_fh = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def triton_http_url(self) -> str:
        """tritonserver's own HTTP address (the guard's upstream; equals http_url without a guard)."""
        return f"{self._triton_host}:{self.triton_http_port}"

    @property
    def _triton_host(self) -> str:
        return "127.0.0.1" if self.http_guard else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.metrics_port}/metrics"

    @property
    def scheme(self) -> str:
        """Of the public HTTP and metrics ports: https when the guard serves TLS."""
        return "https" if self.security.tls and self.http_guard else "http"

    def headers(self, protocol: str, admin: bool = False) -> dict:
        """Headers with this server's keys for tritonclient `protocol` "http" / "grpc" (admin: the admin key too)."""
        return self.security.headers(protocol, admin)

    def urlopen(self, path: str, data: Optional[bytes] = None, admin: bool = False, timeout: float = 30.0):
        """This process's own request to its public HTTP port (readiness, the model index)."""
        headers = dict(self.headers("http", admin), **({"Content-Type": "application/json"} if data else {}))
        req = urllib.request.Request(f"{self.scheme}://{self.http_url}{path}", data=data, headers=headers)
        ctx = local_client_ssl_context() if self.scheme == "https" else None
        return urllib.request.urlopen(req, timeout=timeout, context=ctx)

    def command(self) -> List[str]:
        cmd = [wheel_paths()["binary"], f"--model-repository={self.repo}",
               f"--backend-directory={self.backend_dir}", "--model-control-mode=explicit",
               f"--http-address={self._triton_host}", f"--http-port={self.triton_http_port}",
               f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self._triton_host}", f"--metrics-port={self.triton_metrics_port}",
               f"--exit-on-error={'true' if self.exit_on_error else 'false'}",
               "--strict-readiness=true", f"--exit-timeout-secs={EXIT_TIMEOUT_S}", f"--log-verbose={self.log_verbose}"]
        cmd += [f"--load-model={m}" for m in self.load_models]
        return cmd + shm_backend_args(self.shm_prefix) + self.security.triton_args() + self.extra_args

    def ports(self) -> List[tuple]:
        """(what, port) of every port this server listens on, the guard's internal ones included."""
        ports = [("HTTP", self.http_port), ("gRPC", self.grpc_port), ("metrics", self.metrics_port)]
        if self.http_guard:
            ports += [("tritonserver's internal HTTP", self.triton_http_port),
                      ("tritonserver's internal metrics", self.triton_metrics_port)]
        return ports

    def start(self, wait: bool = True, timeout: float = 300.0) -> "TritonServer":
        if self.backend_dir is None:
            self.backend_dir = prepare_backend_dir()
        install_tritium_backend(self.backend_dir)
        # Fail before launching, with every taken port named at once, rather than leave it to the log.
        check_ports_free(self.host, self.ports())
        routes = []
        try:
            if self.http_guard:  # hold the public ports now: no other server can take them from here on
                routes.append((listen_socket("HTTP", self.host, self.http_port), self.triton_http_url, True))
                routes.append((listen_socket("metrics", self.host, self.metrics_port),
                               f"127.0.0.1:{self.triton_metrics_port}", False))
            out = subprocess.DEVNULL
            if self.log_file:
                self._log_fh = open(self.log_file, "ab")
                out = self._log_fh
            if routes:
                self.guard_proc = start_guard(routes, self.guard_limits, self._log_fh, self.security)
        finally:
            for route in routes:
                route[0].close()  # the guard holds its own copies
        # Own process group: stop() can reap the Python backend stubs along with the server.
        self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, env=server_env(),
                                     start_new_session=True)
        if wait:
            self.wait_ready(timeout)
        return self

    def is_ready(self) -> bool:
        try:
            with self.urlopen("/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until /v2/health/ready answers 200; raise with the log tail if the server dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode} before it was ready"
                                   + self._log_hint())
            if self.guard_proc is not None and self.guard_proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"the HTTP guard exited with code {self.guard_proc.returncode}" + self._log_hint())
            if self.is_ready():
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s" + self._log_hint())

    def _log_hint(self) -> str:
        if not self.log_file or not os.path.exists(self.log_file):
            return ""
        lines = load_failures(self.log_file)
        return ("\n" + "\n".join(lines)) if lines else f" (log: {self.log_file})"

    def stop(self) -> Optional[int]:
        """SIGINT, wait, then SIGKILL the whole process group; returns the exit code."""
        if self.proc is None:
            return None
        rc = stop_process_group(self.proc, self.stop_timeout)
        self._stop_guard()
        remove_shm_files(self.shm_prefix)
        if self._log_fh:
            self._log_fh.close()
            self._log_fh = None
        return rc

    def _stop_guard(self) -> None:
        if self.guard_proc is not None and self.guard_proc.poll() is None:
            self.guard_proc.terminate()
            try:
                self.guard_proc.wait(5)
            except subprocess.TimeoutExpired:
                self.guard_proc.kill()
                self.guard_proc.wait()

    def __enter__(self):
        return self.start() if self.proc is None else self

    def __exit__(self, *exc):
        self.stop()


def load_failures(log_file: str) -> List[str]:
    """The server log's model-load failures as one line each: "failed to load 'x' version 1: reason"."""
    out = []
    pat = re.compile(r"failed to load '([^']+)' version (\d+): (.*)")
    with open(log_file, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = pat.search(line)
            if m:
                # Triton escapes the Python traceback into the same line after "\n"; keep the reason.
                reason = m.group(3).split("\\n")[0].rstrip('"').strip()
                out.append(f"failed to load '{m.group(1)}' version {m.group(2)}: {reason}")
    return out
