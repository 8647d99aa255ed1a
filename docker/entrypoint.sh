#!/bin/sh
# tritonserver with its HTTP and metrics ports behind the Tritium HTTP guard
# (client/serve/http_guard.py): tritonserver 2.51 (NGC 24.10) dies on some single HTTP requests
# (a 5 MB+ form-urlencoded body, JSON nested ~200,000 deep); the guard refuses them first.
# gRPC (8001) is served by tritonserver directly. Beside them, the OpenAI-compatible API
# (client/openai/openai_server.py) on OPENAI_PORT (9000; -1 = off), forwarding to tritonserver's gRPC.
# Extra arguments go to tritonserver.
#
# Secure by default, as `tritium serve` (docs/security.md). The container listens on 0.0.0.0, so:
#   TRITIUM_API_KEY    required: every inference / OpenAI request sends 'Authorization: Bearer KEY'
#                      (TRITIUM_INSECURE=1 serves without one; anyone who reaches the ports may infer)
#   TRITIUM_ADMIN_KEY  unlocks Triton's model-repository, model-config, shared-memory, trace and
#                      logging APIs (header 'tritium-admin-key'); unset, they are refused to everyone
#   TRITIUM_TLS_CERT, TRITIUM_TLS_KEY   PEM files: TLS on the HTTP, gRPC, metrics and OpenAI ports
set -eu
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
OPENAI_PORT=${OPENAI_PORT:-9000}
BIND=${TRITIUM_BIND:-0.0.0.0}
TRITON_HTTP_PORT=${TRITON_HTTP_PORT:-18000}        # tritonserver's own, loopback only
TRITON_METRICS_PORT=${TRITON_METRICS_PORT:-18002}
TLS_CERT=${TRITIUM_TLS_CERT:-}
TLS_KEY=${TRITIUM_TLS_KEY:-}
INSECURE=${TRITIUM_INSECURE:-0}

if [ -z "${TRITIUM_API_KEY:-}" ] && [ "$INSECURE" != "1" ]; then
    echo "tritium: this container serves inference on $BIND ports $HTTP_PORT (HTTP), $GRPC_PORT (gRPC), $OPENAI_PORT (OpenAI API) and metrics on $METRICS_PORT with no key: set one with -e TRITIUM_API_KEY=KEY (make one with python3 -c 'import secrets; print(secrets.token_urlsafe(32))'), add TRITIUM_TLS_CERT/TRITIUM_TLS_KEY for TLS, or -e TRITIUM_INSECURE=1 to serve it open" >&2
    exit 2
fi
# The keys' form (16+ characters of A-Z a-z 0-9 - . _ ~ + /) and the TLS pair, checked as `tritium serve` does.
python3 -c 'import os, sys
from tritium.client.security import Security, server_ssl_context
try:
    Security(api_key=os.environ.get("TRITIUM_API_KEY") or None, admin_key=os.environ.get("TRITIUM_ADMIN_KEY") or None,
             tls_cert=os.environ.get("TRITIUM_TLS_CERT") or None, tls_key=os.environ.get("TRITIUM_TLS_KEY") or None)
    if os.environ.get("TRITIUM_TLS_CERT"):
        server_ssl_context(os.environ["TRITIUM_TLS_CERT"], os.environ.get("TRITIUM_TLS_KEY", ""))
except ValueError as e:
    sys.exit(f"tritium: {e}")' || exit 2

ADMIN_CONFIGURED=0
if [ -n "${TRITIUM_ADMIN_KEY:-}" ]; then
    ADMIN_KEY=$TRITIUM_ADMIN_KEY
    ADMIN_CONFIGURED=1
else  # known only to this container's processes: the admin APIs are refused to every client
    ADMIN_KEY=$(python3 -c 'import secrets; print(secrets.token_urlsafe(32))')
fi
ADMIN_APIS=model-repository,model-config,shared-memory,trace,logging
KEYED_APIS=inference,metadata,statistics
set -- "--http-restricted-api=$ADMIN_APIS:tritium-admin-key=$ADMIN_KEY" \
       "--grpc-restricted-protocol=$ADMIN_APIS:tritium-admin-key=$ADMIN_KEY" "$@"
if [ -n "${TRITIUM_API_KEY:-}" ]; then
    set -- "--http-restricted-api=$KEYED_APIS:authorization=Bearer $TRITIUM_API_KEY" \
           "--grpc-restricted-protocol=$KEYED_APIS:authorization=Bearer $TRITIUM_API_KEY" "$@"
fi
GUARD_TLS=""
OPENAI_TLS=""
if [ -n "$TLS_CERT" ]; then
    set -- --grpc-use-ssl=true "--grpc-server-cert=$TLS_CERT" "--grpc-server-key=$TLS_KEY" "$@"
    GUARD_TLS="--tls-cert $TLS_CERT --tls-key $TLS_KEY"
    OPENAI_TLS="--tls-cert $TLS_CERT --tls-key $TLS_KEY --triton-tls-ca $TLS_CERT"
fi

# idle OpenMP threads sleep instead of spinning: on shared cores spinning stalls every parallel
# region (client/cli/main.py, builder/build_threads.py)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
tritonserver --model-repository="${MODEL_REPOSITORY:-/models}" --model-control-mode=explicit --load-model='*' \
    --http-address=127.0.0.1 --http-port="$TRITON_HTTP_PORT" \
    --metrics-address=127.0.0.1 --metrics-port="$TRITON_METRICS_PORT" \
    --grpc-address="$BIND" --grpc-port="$GRPC_PORT" "$@" &
TRITON=$!
# shellcheck disable=SC2086  # GUARD_TLS / OPENAI_TLS: paths without spaces, split on purpose
TRITIUM_GUARD_ADMIN_KEY=$ADMIN_KEY TRITIUM_GUARD_ADMIN_CONFIGURED=$ADMIN_CONFIGURED \
TRITIUM_GUARD_API_KEY=${TRITIUM_API_KEY:-} \
    python3 -m tritium.client.serve.http_guard --route "$BIND:$HTTP_PORT=127.0.0.1:$TRITON_HTTP_PORT" \
    --open-route "$BIND:$METRICS_PORT=127.0.0.1:$TRITON_METRICS_PORT" $GUARD_TLS &
GUARD=$!
OPENAI=$GUARD
if [ "$OPENAI_PORT" != "-1" ]; then
    OPENAI_INSECURE=""
    [ "$INSECURE" = "1" ] && OPENAI_INSECURE="--insecure"
    # shellcheck disable=SC2086
    TRITIUM_ADMIN_KEY=$ADMIN_KEY python3 -m tritium.client.cli openai --triton-url "127.0.0.1:$GRPC_PORT" \
        --host "$BIND" --port "$OPENAI_PORT" $OPENAI_TLS $OPENAI_INSECURE &
    OPENAI=$!
fi
trap 'kill -INT "$TRITON" 2>/dev/null; kill -TERM "$GUARD" "$OPENAI" 2>/dev/null' INT TERM
# Whichever stops first takes the others down, so the container's health reflects all of them.
while kill -0 "$TRITON" 2>/dev/null && kill -0 "$GUARD" 2>/dev/null && kill -0 "$OPENAI" 2>/dev/null; do sleep 1; done
kill -INT "$TRITON" 2>/dev/null || true
kill -TERM "$GUARD" "$OPENAI" 2>/dev/null || true
wait "$TRITON" 2>/dev/null || true
