"""Randomized requests for the stress tool (client/tools/stress.py): well-formed, odd and hostile, sent
raw over gRPC (any tensor dtype) or HTTP (generate endpoint JSON), plus server RSS and KV probes."""
from __future__ import annotations

import json
import queue
import random
import re
import urllib.error
import urllib.request
from typing import Dict, Optional, Tuple

import numpy as np

PROMPTS = ["Hello", "The quick brown fox", "naïve café — 日本語 🙂", "1 2 3 4 5 6 7 8 9", "\n\n\t  ", "<|im_start|>"]
WORDS = ["the", "a", "fox", "é", "🙂", " ", "end", "###"]


def _text(rng: random.Random) -> object:
    r = rng.random()
    if r < 0.6:
        return rng.choice(PROMPTS) + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 20)))
    if r < 0.7:
        return "".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 200)))
    if r < 0.8:
        return "word " * rng.randint(1000, 4000)   # often longer than max_seq_len
    if r < 0.85:
        return ""
    if r < 0.9:
        return bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 64)))  # maybe not UTF-8
    return rng.choice(PROMPTS)


_ODD = {
    "max_tokens": [1, 4, 16, 32, 0, -1, 10 ** 9],
    "temperature": [0.0, 0.7, 1.0, 1e-38, 1.4e-45, 1e38, float("nan"), float("inf"), -1.0],
    "top_k": [0, 1, 5, -1, -5, 10 ** 9],
    "top_p": [1.0, 0.5, 0.01, 0.0, 2.0, float("nan")],
    "min_p": [0.0, 0.1, 1.0, -0.5],
    "repetition_penalty": [1.0, 1.3, 0.0, 100.0],
    "presence_penalty": [0.0, 1.5, -3.0],
    "frequency_penalty": [0.0, 0.5, 5.0],
    "seed": [0, 7, 2 ** 62, -1],
    "min_tokens": [0, 2, 100],
    "num_return_sequences": [1, 2, 3, 0, 1000],
}
_SAMPLING_PARAMETERS = ['{"temperature": 0.5, "stop": ["###"]}', '{"ignore_eos": true}', "[" * 5000, "{",
                        '{"seed": ' + "9" * 5000 + "}", '{"temprature": 1}', json.dumps({"bad_words": ["x"] * 300}),
                        '{"stop": ' + "[" * 100 + "]" * 100 + "}", '{"max_tokens": "8", "top_k": "3"}']


def random_request(rng: random.Random, grpc: bool) -> Dict[str, object]:
    """One request's fields: name -> python value (or a numpy array with an odd dtype, gRPC only)."""
    fields: Dict[str, object] = {"text_input": _text(rng)}
    if not grpc and isinstance(fields["text_input"], bytes):
        fields["text_input"] = fields["text_input"].decode("latin-1")
    for name, values in _ODD.items():
        if rng.random() < 0.3:
            fields[name] = rng.choice(values)
    fields.setdefault("max_tokens", rng.choice([1, 4, 8, 16]))
    if rng.random() < 0.1:
        fields["bad_words"] = [rng.choice(WORDS) * rng.randint(1, 3) for _ in range(rng.choice([1, 10, 300]))]
    if rng.random() < 0.1:
        fields["stop_words"] = [rng.choice(WORDS) for _ in range(rng.choice([1, 5, 40]))]
    if rng.random() < 0.1:
        fields["sampling_parameters"] = rng.choice(_SAMPLING_PARAMETERS)
    if rng.random() < 0.05:
        fields["no_such_input"] = 1
    if grpc and rng.random() < 0.05:  # a wrong dtype
        fields["temperature"] = np.array([[1]], dtype=np.int32)
    if grpc and rng.random() < 0.05:  # two rows in one request
        fields["text_input"] = np.array([[b"Hello"], [b"The quick"]], dtype=np.object_)
    fields["stream"] = rng.random() < 0.5
    return fields


def _array(name: str, v) -> Tuple[np.ndarray, str]:
    if isinstance(v, np.ndarray):
        arr = v
    elif isinstance(v, (str, bytes)):
        arr = np.array([[v.encode("utf-8") if isinstance(v, str) else v]], dtype=np.object_)
    elif isinstance(v, list):
        arr = np.array([[w.encode("utf-8") for w in v]], dtype=np.object_)
    elif isinstance(v, bool):
        arr = np.array([[v]], dtype=np.bool_)
    elif isinstance(v, float):
        arr = np.array([[v]], dtype=np.float32)
    else:
        arr = np.array([[max(min(v, 2 ** 31 - 1), -2 ** 31)]], dtype=np.int32)
    kind = {np.object_: "BYTES", np.float32: "FP32", np.int32: "INT32", np.bool_: "BOOL"}[arr.dtype.type]
    return arr, kind


def send_grpc(url: str, model: str, fields: Dict[str, object], timeout: float) -> Tuple[str, int]:
    """("ok" | "error" | "hang", tokens received). An error answer is fine; silence is a hang."""
    import tritonclient.grpc as grpcclient
    results: "queue.Queue" = queue.Queue()
    cl = grpcclient.InferenceServerClient(url)
    tokens, finished = 0, False
    try:
        cl.start_stream(callback=lambda result, error: results.put((result, error)))
        inputs = []
        for name, v in fields.items():
            arr, kind = _array(name, v)
            inp = grpcclient.InferInput(name, list(arr.shape), kind)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        cl.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            try:
                r, e = results.get(timeout=timeout)
            except queue.Empty:
                return "hang", tokens
            if e is not None:
                finished = True
                return "error", tokens
            if r.get_response().outputs:
                tokens += int(np.asarray(r.as_numpy("output_ids")).size)
            if r.get_response().parameters["triton_final_response"].bool_param:
                finished = True
                return "ok", tokens
    finally:
        # Cancelling a finished stream would be harmless, but it is not what a client does.
        cl.stop_stream(cancel_requests=not finished)
        cl.close()


def send_http(url: str, model: str, fields: Dict[str, object], timeout: float) -> Tuple[str, int]:
    body = dict(fields)
    endpoint = "generate_stream" if body.get("stream") else "generate"
    data = json.dumps(body, allow_nan=True).encode("utf-8")
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/{endpoint}", data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError:
        return "error", 0
    except (TimeoutError, OSError) as e:
        return ("hang" if "timed out" in str(e) else "down"), 0
    return ("error" if '"error"' in text else "ok"), text.count("output_ids")


def kv_blocks_used(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(r'^tritium_kv_cache_blocks\{[^}]*state="used"[^}]*\} (\S+)$', text, re.M))


def group_rss_bytes(pgids) -> int:
    """Resident memory of every process in the given process groups (tritonserver, its stubs, the guard)."""
    from tritium.client.serve.proc_cpu import group_processes
    total = 0
    for pid, _ in group_processes(set(pgids)):
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(line for line in f if line.startswith("VmRSS:"))
            total += int(rss.split()[1]) * 1024
        except (OSError, ValueError, IndexError, StopIteration):
            continue
    return total


def server_alive(srv) -> Optional[bool]:
    """True/False for a server we started (TritonServer), None when we only know its URL."""
    return None if srv is None else (srv.proc.poll() is None and srv.is_ready())
