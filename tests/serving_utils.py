"""Helpers for the serving tests: /metrics scraping, polling, raw gRPC requests, a cancelled stream."""
from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np


def scrape(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        return r.read().decode()


def metric(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        lab = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(lab.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name}{labels} not in /metrics"
    return total


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def raw_grpc(server, model, fields):
    """Send raw tensors (any dtype) over gRPC; returns (outputs list, error message or None)."""
    import tritonclient.grpc as grpcclient
    results = queue.Queue()
    cl = grpcclient.InferenceServerClient(server.grpc_url)
    cl.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    for name, v in fields.items():
        if v is None:
            continue
        if isinstance(v, str):
            arr = np.array([[v.encode()]], dtype=np.object_)
        elif isinstance(v, np.ndarray):
            arr = v
        else:
            arr = np.array([[v]], dtype=np.float32 if isinstance(v, float) else np.int32)
        dt = {np.object_: "BYTES", np.float32: "FP32", np.int32: "INT32"}[arr.dtype.type]
        inp = grpcclient.InferInput(name, list(arr.shape), dt)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    cl.async_stream_infer(model, inputs, enable_empty_final_response=True)
    outs, err = [], None
    try:
        while True:
            r, e = results.get(timeout=60)
            if e is not None:
                err = str(e)
                break
            if r.get_response().outputs:
                outs.append(r)
            if r.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        cl.stop_stream()
        cl.close()
    return outs, err


def greedy_stream(grpc_url, model, prompt, max_tokens, stream=True, headers=None):
    """A greedy request (EOS ignored) over the gRPC stream, asking for output_ids, text_output and
    num_output_tokens: [(output_ids, text, num_output_tokens)] of each response that carried outputs."""
    import tritonclient.grpc as grpcclient
    results = queue.Queue()
    cl = grpcclient.InferenceServerClient(grpc_url)
    cl.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    fields = {"text_input": (np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
              "max_tokens": (np.array([[max_tokens]], dtype=np.int32), "INT32"),
              "stream": (np.array([[stream]], dtype=np.bool_), "BOOL"),
              "temperature": (np.array([[0.0]], dtype=np.float32), "FP32"),
              "sampling_parameters": (np.array([[b'{"ignore_eos": true}']], dtype=np.object_), "BYTES")}
    inputs = []
    for name, (arr, dtype) in fields.items():
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outs = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "text_output", "num_output_tokens")]
    cl.async_stream_infer(model, inputs, outputs=outs, enable_empty_final_response=True)
    got = []
    try:
        while True:
            # generous: a tiny engine answers in well under a second, but on a loaded 2-core host
            # beside other servers a response can wait tens of seconds; a hang still fails
            r, e = results.get(timeout=120)
            assert e is None, e
            if r.get_response().outputs:
                got.append((r.as_numpy("output_ids").reshape(-1).tolist(),
                            r.as_numpy("text_output").reshape(-1)[0].decode(),
                            int(r.as_numpy("num_output_tokens").reshape(-1)[0])))
            if r.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        cl.stop_stream()
        cl.close()


def cancel_beside_others(others_client, cancel_client, other_prompts, other_tokens: int,
                         cancel_prompt: str, cancel_tokens: int, chunks: int = 3):
    """Stream `other_prompts` (each exactly other_tokens tokens, EOS banned) in threads while one
    more stream of cancel_tokens is read for `chunks` chunks and then closed (which cancels it).
    Returns (token counts of the other streams, their errors)."""
    others, errors = [], []

    def run_other(prompt):
        try:
            others.append(sum(len(ch.token_ids) for ch in others_client().stream(
                prompt, max_tokens=other_tokens, temperature=0.0, min_tokens=other_tokens)))
        except Exception as e:  # reported to the caller
            errors.append(e)
    threads = [threading.Thread(target=run_other, args=(p,)) for p in other_prompts]
    for t in threads:
        t.start()
    stream = cancel_client().stream(cancel_prompt, max_tokens=cancel_tokens, temperature=0.0,
                                    min_tokens=cancel_tokens)
    try:
        for _ in range(chunks):
            next(stream)
    finally:
        stream.close()  # gRPC: stop_stream(cancel_requests=True); HTTP: the connection closes
    for t in threads:
        t.join(120)
    return others, errors


@contextlib.contextmanager
def tritium_serve(repo: str, root: str, *extra_args: str, env: dict = None, timeout_s: float = 600):
    """Run `tritium serve --repo REPO` as a user starts it (every port free-picked, its own log file
    under ROOT), wait for its ready line, yield (process, the lines it printed until ready), and
    stop it with Ctrl-C afterwards, asserting a clean exit. ENV replaces the process environment."""
    proc = subprocess.Popen([sys.executable, "-m", "tritium.client.cli", "serve", "--repo", repo, "--http-port", "0",
                             "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0", *extra_args,
                             "--log-file", os.path.join(str(root), "server.log")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=os.environ.copy() if env is None else env)
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Ctrl-C stops"):
            break
    if not lines or not lines[-1].startswith("Ctrl-C stops"):
        proc.kill()
        raise AssertionError("tritium serve never became ready:\n" + "".join(lines[-30:]))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain the rest
    try:
        yield proc, lines
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0


@contextlib.contextmanager
def served_tiny_engine(tiny_checkpoint, root, name: str):
    """(engine_dir, tritonserver) for a tiny float32 llama engine built and served the way a user
    does it (`tritium build --repo`, then tritonserver on that repository), stopped on exit."""
    from tritium.client.cli.main import main
    from tritium.client.serve.server import TritonServer
    engine, repo = str(root / "engine"), str(root / "repo")
    assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--quiet",
                 "--repo", repo, "--name", name]) == 0
    srv = TritonServer(repo, log_file=str(root / "server.log"), load_models=[name])
    srv.start(timeout=240)  # a cold start compiles the native kernels and loads the stub
    try:
        yield engine, srv
    finally:
        assert srv.stop() == 0
