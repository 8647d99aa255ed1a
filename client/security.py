"""Who may call what on the serving ports: the API key, the admin key, TLS files, and the rule
that refuses to serve an open API on a non-loopback address (docs/security.md).

Triton's APIs fall in three groups (names as `tritonserver --http-restricted-api` spells them):
  ADMIN_APIS  model-repository (load / unload, with file overrides: code upload into a Python
              model), model-config, shared-memory (system and CUDA), trace, logging. Always
              restricted: they need the admin key (header `tritium-admin-key`). Without a
              configured admin key the server makes up a random one that only `tritium serve`
              itself knows (it lists the ready models and the OpenAI bridge reads configs), so
              for everyone else these APIs are simply refused.
  KEYED_APIS  inference, metadata, statistics: need `Authorization: Bearer API_KEY` when an API
              key is configured, else open.
  OPEN_APIS   health: always open (liveness / readiness probes).
tritonserver enforces the groups itself on gRPC (header `triton-grpc-protocol-<name>`, its
prefix) and on its own loopback HTTP port; the HTTP guard checks the same headers first.
"""
from __future__ import annotations

import hmac
import ipaddress
import os
import re
import secrets
import ssl
from dataclasses import dataclass, field
from typing import Dict, List, Optional

API_KEY_ENV = "TRITIUM_API_KEY"
ADMIN_KEY_ENV = "TRITIUM_ADMIN_KEY"
ADMIN_HEADER = "tritium-admin-key"
API_KEY_HEADER = "authorization"          # value: "Bearer <API key>"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # tritonserver 2.51 expects this prefix on gRPC
ADMIN_APIS = ("model-repository", "model-config", "shared-memory", "trace", "logging")
KEYED_APIS = ("inference", "metadata", "statistics")
OPEN_APIS = ("health",)
MIN_KEY_CHARS = 16
# RFC 6750's b64token: what a Bearer token may hold; no spaces, ':' or ',' (tritonserver's
# --*-restricted-api syntax uses those as separators).
_KEY_RE = re.compile(r"[A-Za-z0-9._~+/-]+=*")
NEW_KEY_HINT = "python -c 'import secrets; print(secrets.token_urlsafe(32))'"


def check_key(value: Optional[str], what: str) -> Optional[str]:
    """The key itself, or ValueError naming `what` (the flag) and the allowed form."""
    if value is None or value == "":
        return None
    if not _KEY_RE.fullmatch(value):
        raise ValueError(f"{what}: a key may hold only letters, digits and - . _ ~ + / (and trailing =); "
                         f"make one with {NEW_KEY_HINT}")
    if len(value) < MIN_KEY_CHARS:
        raise ValueError(f"{what}: a key must have at least {MIN_KEY_CHARS} characters, got {len(value)}; "
                         f"make one with {NEW_KEY_HINT}")
    return value


def keys_match(given: Optional[str], expected: Optional[str]) -> bool:
    """Constant-time comparison (hmac.compare_digest): the time taken says nothing about the key."""
    if given is None or expected is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


def bearer_token(authorization: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer TOKEN` header value (None if absent or another scheme)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def key_headers(api_key: Optional[str], protocol: str) -> Dict[str, str]:
    """The header carrying `api_key` on `protocol` "http" / "grpc" ({} without a key)."""
    if not api_key:
        return {}
    prefix = GRPC_HEADER_PREFIX if protocol == "grpc" else ""
    return {prefix + API_KEY_HEADER: f"Bearer {api_key}"}


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; 0.0.0.0, :: and every other address are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


@dataclass(frozen=True)
class Security:
    """The serving ports' keys and TLS files. `admin_key` None: the admin APIs are refused to
    everyone but this process, which holds `internal_admin_key` (random, never printed)."""
    api_key: Optional[str] = None
    admin_key: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    internal_admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    def __post_init__(self):
        check_key(self.api_key, f"--api-key / ${API_KEY_ENV}")
        check_key(self.admin_key, f"--admin-key / ${ADMIN_KEY_ENV}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together: give both PEM files or neither")

    def __repr__(self) -> str:  # never a key in a log line
        return (f"Security(api_key={'set' if self.api_key else None}, admin_key={'set' if self.admin_key else None}, "
                f"tls={self.tls})")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    @property
    def admin_secret(self) -> str:
        """The admin key tritonserver and the guard are given (the configured one, else the random one)."""
        return self.admin_key or self.internal_admin_key

    def triton_args(self) -> List[str]:
        """tritonserver flags: the restricted API groups on HTTP and gRPC, and gRPC TLS."""
        groups = [(ADMIN_APIS, ADMIN_HEADER, self.admin_secret)]
        if self.api_key:
            groups.append((KEYED_APIS, API_KEY_HEADER, f"Bearer {self.api_key}"))
        args = []
        for apis, header, value in groups:
            spec = f"{','.join(apis)}:{header}={value}"
            args += [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]
        if self.tls:
            args += ["--grpc-use-ssl=true", f"--grpc-server-cert={self.tls_cert}", f"--grpc-server-key={self.tls_key}"]
        return args

    def headers(self, protocol: str, admin: bool = False) -> Dict[str, str]:
        """Request headers carrying this server's keys for `protocol` "http" or "grpc"; with
        admin=True the admin key too (this process's own calls: index, configs)."""
        out = {}
        if self.api_key:
            out[API_KEY_HEADER] = f"Bearer {self.api_key}"
        if admin:
            out[ADMIN_HEADER] = self.admin_secret
        if protocol == "grpc":
            return {GRPC_HEADER_PREFIX + k: v for k, v in out.items()}
        return out

    def guard_env(self) -> Dict[str, str]:
        """The HTTP guard's keys, passed in its environment (not its command line)."""
        env = {"TRITIUM_GUARD_ADMIN_KEY": self.admin_secret,
               "TRITIUM_GUARD_ADMIN_CONFIGURED": "1" if self.admin_key else "0"}
        if self.api_key:
            env["TRITIUM_GUARD_API_KEY"] = self.api_key
        return env

    def server_ssl_context(self) -> Optional[ssl.SSLContext]:
        if not self.tls:
            return None
        return server_ssl_context(self.tls_cert, self.tls_key)


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context from PEM files; ValueError naming the file if they do not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: cannot load the certificate and key ({e})") from None
    return ctx


def local_client_ssl_context() -> ssl.SSLContext:
    """For this process's own calls to a port it bound itself (readiness, the model list): the
    socket is ours, so the certificate is not checked (it may name a public host, not 127.0.0.1)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def cert_host_name(cert: str) -> str:
    """A host name the certificate is valid for (first DNS subjectAltName, else its CN), so that
    a local gRPC client can reach 127.0.0.1 while checking the certificate; "localhost" if unknown."""
    try:
        info = ssl._ssl._test_decode_cert(cert)  # CPython's PEM decoder (no extra dependency)
    except (AttributeError, OSError, ssl.SSLError, ValueError):
        return "localhost"
    for kind, value in info.get("subjectAltName", ()):
        if kind == "DNS":
            return value
    for rdn in info.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    return "localhost"


def grpc_tls_kwargs(ca: Optional[str]) -> dict:
    """tritonclient gRPC client arguments for TLS trusting the PEM file `ca` ({} when None), with
    the server name taken from the certificate, so that a 127.0.0.1 address still verifies."""
    if not ca:
        return {}
    from tritonclient.grpc import KeepAliveOptions
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE
    k = KeepAliveOptions()
    args = [("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),  # tritonclient's own defaults
            ("grpc.keepalive_time_ms", k.keepalive_time_ms), ("grpc.keepalive_timeout_ms", k.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", k.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", k.http2_max_pings_without_data),
            ("grpc.ssl_target_name_override", cert_host_name(ca))]
    return dict(ssl=True, root_certificates=ca, channel_args=args)


def add_arguments(p) -> None:
    """The security flags of `tritium serve` and `tritium openai`."""
    p.add_argument("--api-key", default=None,
                   help=f"key every inference / OpenAI request must send as 'Authorization: Bearer KEY' "
                        f"(default: ${API_KEY_ENV}; none = open). At least {MIN_KEY_CHARS} characters")
    p.add_argument("--admin-key", default=None,
                   help=f"key that unlocks Triton's model-repository, model-config, shared-memory, trace and "
                        f"logging APIs (header '{ADMIN_HEADER}: KEY'; gRPC '{GRPC_HEADER_PREFIX}{ADMIN_HEADER}'); "
                        f"default: ${ADMIN_KEY_ENV}; none = those APIs are refused")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTP, gRPC and the OpenAI API over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without --api-key (anyone who reaches the ports may infer)")


def security_from_args(args) -> Security:
    """Security from the flags, falling back on $TRITIUM_API_KEY / $TRITIUM_ADMIN_KEY."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    admin_key = args.admin_key if args.admin_key is not None else os.environ.get(ADMIN_KEY_ENV)
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    sec = Security(api_key=api_key or None, admin_key=admin_key or None, tls_cert=args.tls_cert, tls_key=args.tls_key)
    sec.server_ssl_context()  # a bad certificate / key pair fails here, before anything starts
    return sec


def check_exposure(host: str, security: Security, insecure: bool, exposed: str) -> None:
    """ValueError (exit 2, one line) when `host` is not loopback, no API key is set and not
    `insecure`; `exposed` names what would be open (ports and APIs)."""
    if is_loopback(host) or security.api_key or insecure:
        return
    raise ValueError(f"--host {host} would expose {exposed} to the network with no key: set one with "
                     f"--api-key KEY or ${API_KEY_ENV} (make one with {NEW_KEY_HINT}), add --tls-cert/--tls-key "
                     f"for TLS, or pass --insecure to serve it open")
