#!/bin/sh
# tritonserver with its HTTP and metrics ports behind the Tritium HTTP guard
# (client/http_guard.py): tritonserver 2.51 (NGC 24.10) dies on some single HTTP requests
# (a 5 MB+ form-urlencoded body, JSON nested ~200,000 deep); the guard refuses them first.
# gRPC (8001) is served by tritonserver directly. Beside them, the OpenAI-compatible API
# (client/openai_server.py) on OPENAI_PORT (9000; -1 = off), forwarding to tritonserver's gRPC.
# Extra arguments go to tritonserver.
set -eu
HTTP_PORT=${HTTP_PORT:-8000}
GRPC_PORT=${GRPC_PORT:-8001}
METRICS_PORT=${METRICS_PORT:-8002}
OPENAI_PORT=${OPENAI_PORT:-9000}
# idle OpenMP threads sleep instead of spinning: on shared cores spinning stalls every parallel
# region (client/cli.py, builder/build_threads.py)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
tritonserver --model-repository="${MODEL_REPOSITORY:-/models}" --model-control-mode=explicit --load-model='*' \
    --http-address=127.0.0.1 --http-port=18000 --metrics-address=127.0.0.1 --metrics-port=18002 \
    --grpc-address=0.0.0.0 --grpc-port="$GRPC_PORT" "$@" &
TRITON=$!
python3 -m tritium.client.http_guard --route "0.0.0.0:$HTTP_PORT=127.0.0.1:18000" \
    --route "0.0.0.0:$METRICS_PORT=127.0.0.1:18002" &
GUARD=$!
OPENAI=$GUARD
if [ "$OPENAI_PORT" != "-1" ]; then
    python3 -m tritium.client.cli openai --triton-url "127.0.0.1:$GRPC_PORT" --host 0.0.0.0 --port "$OPENAI_PORT" &
    OPENAI=$!
fi
trap 'kill -INT "$TRITON" 2>/dev/null; kill -TERM "$GUARD" "$OPENAI" 2>/dev/null' INT TERM
# Whichever stops first takes the others down, so the container's health reflects all of them.
while kill -0 "$TRITON" 2>/dev/null && kill -0 "$GUARD" 2>/dev/null && kill -0 "$OPENAI" 2>/dev/null; do sleep 1; done
kill -INT "$TRITON" 2>/dev/null || true
kill -TERM "$GUARD" "$OPENAI" 2>/dev/null || true
wait "$TRITON" 2>/dev/null || true
