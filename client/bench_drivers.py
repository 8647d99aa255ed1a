"""How the serving benchmark talks to a system: Triton gRPC streaming, OpenAI SSE, in-process.

Every driver gives each benchmark worker thread its own session (a gRPC stream, a keep-alive
HTTP connection, or a stream of the in-process AsyncLLMEngine) and returns one RequestResult per
request: the send time, the arrival time and token count of every streamed chunk, the end time
and the token counts the system reported. All requests are greedy with EOS ignored, so every
system generates exactly `max_tokens` tokens; a different count is reported as a mismatch.
"""
from __future__ import annotations

import http.client
import json
import queue
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from tritium.client.bench_workload import BenchRequest

now = time.perf_counter


@dataclass
class RequestResult:
    """What one request measured (times from time.perf_counter, in seconds)."""
    index: int
    max_tokens: int                                          # tokens requested
    t_send: float
    t_end: Optional[float] = None                            # final response (or the error)
    chunk_times: List[float] = field(default_factory=list)   # arrival of each chunk holding tokens
    chunk_tokens: List[int] = field(default_factory=list)    # tokens in that chunk
    num_output_tokens: Optional[int] = None                  # as the system reported it, if it did
    num_prompt_tokens: Optional[int] = None
    error: Optional[str] = None

    @property
    def output_tokens(self) -> int:
        return self.num_output_tokens if self.num_output_tokens is not None else sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.t_end is not None


class TritonGrpcDriver:
    """Tritium's LLM model on tritonserver, through tritonclient's gRPC bidirectional stream."""
    name = "triton-grpc"
    in_process = False

    def __init__(self, url: str, model: str, timeout: float = 600.0):
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.model = model
        self.timeout = timeout

    def describe(self) -> dict:
        return {"driver": self.name, "url": self.url, "model": self.model}

    def check(self) -> None:
        """Fail early, naming the flag, when the server or the model is not there."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
        try:
            with grpcclient.InferenceServerClient(self.url) as c:
                ready = c.is_model_ready(self.model)
        except InferenceServerException as e:
            raise OSError(f"--url {self.url}: no Triton gRPC server answers ({e.message()})") from None
        if not ready:
            raise ValueError(f"--model {self.model}: not ready on the Triton server at {self.url}")

    def session(self) -> "_TritonSession":
        return _TritonSession(self)

    def close(self) -> None:
        pass


class _TritonSession:
    def __init__(self, drv: TritonGrpcDriver):
        import tritonclient.grpc as grpcclient
        self.drv, self.grpc = drv, grpcclient
        self.client = grpcclient.InferenceServerClient(drv.url)
        self.events: "queue.Queue" = queue.Queue()
        # The callback only stamps the arrival time; decoding happens in the worker thread.
        self.client.start_stream(callback=lambda result, error: self.events.put((now(), result, error)))

    def _inputs(self, req: BenchRequest):
        g = self.grpc
        arrays = {"text_input": ("BYTES", np.array([[req.prompt.encode("utf-8")]], dtype=np.object_)),
                  "max_tokens": ("INT32", np.array([[req.max_tokens]], dtype=np.int32)),
                  "stream": ("BOOL", np.array([[True]], dtype=np.bool_)),
                  "temperature": ("FP32", np.array([[0.0]], dtype=np.float32)),
                  # ignore_eos has no tensor of its own; vllm_backend's JSON parameters carry it.
                  "sampling_parameters": ("BYTES", np.array([[b'{"ignore_eos": true}']], dtype=np.object_))}
        inputs = []
        for name, (dtype, arr) in arrays.items():
            inp = g.InferInput(name, list(arr.shape), dtype)
            inp.set_data_from_numpy(arr)
            inputs.append(inp)
        return inputs

    def run(self, req: BenchRequest, request_id: str) -> RequestResult:
        res = RequestResult(req.index, req.max_tokens, now())
        try:
            self.client.async_stream_infer(self.drv.model, self._inputs(req), request_id=request_id,
                                           enable_empty_final_response=True)
            while True:
                t, result, error = self.events.get(timeout=self.drv.timeout)
                if error is not None:
                    res.error, res.t_end = str(error), t
                    self._restart()
                    return res
                resp = result.get_response()
                if resp.id != request_id:  # a late answer to an earlier, timed-out request
                    continue
                if resp.outputs:
                    ids = result.as_numpy("output_ids")
                    if ids is not None and ids.size:
                        res.chunk_times.append(t)
                        res.chunk_tokens.append(int(ids.size))
                    for name, attr in (("num_output_tokens", "num_output_tokens"),
                                       ("num_input_tokens", "num_prompt_tokens")):
                        a = result.as_numpy(name)
                        if a is not None and a.size:
                            setattr(res, attr, int(a.reshape(-1)[0]))
                final = resp.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    res.t_end = t
                    return res
        except queue.Empty:
            res.error, res.t_end = f"no response within {self.drv.timeout:.0f} s", now()
            self._restart()
        except Exception as e:  # a broken stream must not kill the worker: count it, go on
            res.error, res.t_end = f"{type(e).__name__}: {e}", now()
            self._restart()
        return res

    def _restart(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        except Exception:
            pass
        self.events = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((now(), result, error)))

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        finally:
            self.client.close()


def completions_url(url: str) -> str:
    """http://h:p, http://h:p/v1 or the full /v1/completions URL -> the /v1/completions URL."""
    if "://" not in url:
        url = "http://" + url
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise ValueError(f"--openai-url must be http(s)://HOST:PORT[/v1], got {url!r}")
    path = u.path.rstrip("/")
    if not path.endswith("/completions"):
        path = (path if path.endswith("/v1") else path + "/v1") + "/completions"
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, "", ""))


class OpenAIDriver:
    """Any OpenAI-compatible POST /v1/completions with stream: true (server-sent events).

    Sends temperature 0, ignore_eos (llama-server and vLLM honour it) and
    stream_options.include_usage; each streamed chunk with a choice counts as one token (as
    llama-server and vLLM stream), except a final chunk with finish_reason and no text
    (llama-server's closing chunk); the final usage.completion_tokens, when present, is the
    authoritative count (tokens it reports beyond the chunks are dated to the last chunk).
    """
    name = "openai-sse"
    in_process = False

    def __init__(self, url: str, model: Optional[str] = None, timeout: float = 600.0):
        self.url = completions_url(url)
        self.model = model
        self.timeout = timeout

    def describe(self) -> dict:
        return {"driver": self.name, "url": self.url, "model": self.model}

    def check(self) -> None:
        """Resolve the model name from /v1/models when not given; fail early naming the flag."""
        models_url = self.url[: -len("/completions")] + "/models"
        try:
            with urllib.request.urlopen(models_url, timeout=30) as r:
                data = json.loads(r.read().decode("utf-8"))
        except (OSError, ValueError) as e:
            if self.model is None:
                raise OSError(f"--openai-url {self.url}: GET {models_url} failed ({e}); "
                              f"is the server up? (or pass --openai-model)") from None
            return
        ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
        if self.model is None:
            self.model = ids[0] if ids else "default"

    def session(self) -> "_OpenAISession":
        return _OpenAISession(self)

    def close(self) -> None:
        pass


class _OpenAISession:
    def __init__(self, drv: OpenAIDriver):
        self.drv = drv
        u = urllib.parse.urlsplit(drv.url)
        self.path = u.path
        self.conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self.netloc = u.netloc
        self.conn = None

    def _post(self, body: bytes):
        for attempt in (0, 1):  # a keep-alive connection the server closed: reconnect once
            if self.conn is None:
                self.conn = self.conn_cls(self.netloc, timeout=self.drv.timeout)
            try:
                self.conn.request("POST", self.path, body=body, headers={"Content-Type": "application/json",
                                                                         "Accept": "text/event-stream"})
                return self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise

    def run(self, req: BenchRequest, request_id: str) -> RequestResult:
        body = json.dumps({"model": self.drv.model, "prompt": req.prompt, "max_tokens": req.max_tokens,
                           "temperature": 0.0, "stream": True, "ignore_eos": True,
                           "stream_options": {"include_usage": True}}).encode("utf-8")
        res = RequestResult(req.index, req.max_tokens, now())
        try:
            resp = self._post(body)
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {resp.read().decode('utf-8', 'replace')[:200]}"
            else:
                self._read_events(resp, res)
            res.t_end = now()
        except Exception as e:  # count it and go on with a fresh connection
            res.error, res.t_end = f"{type(e).__name__}: {e}", now()
            if self.conn is not None:
                self.conn.close()
                self.conn = None
        return res

    @staticmethod
    def _read_events(resp, res: RequestResult) -> None:
        while True:
            line = resp.readline()
            if not line:
                break
            t = now()
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            d = json.loads(data)
            if "error" in d:
                res.error = str(d["error"])[:200]
                break
            choice = (d.get("choices") or [None])[0]
            # llama-server ends with an empty-text chunk carrying finish_reason: no token in it.
            if choice is not None and (choice.get("finish_reason") is None or choice.get("text")):
                res.chunk_times.append(t)
                res.chunk_tokens.append(1)
            usage = d.get("usage") or {}
            if usage.get("completion_tokens") is not None:
                res.num_output_tokens = int(usage["completion_tokens"])
                res.num_prompt_tokens = usage.get("prompt_tokens")
        resp.read()  # drain so the keep-alive connection can carry the next request
        extra = (res.num_output_tokens or 0) - sum(res.chunk_tokens)
        if extra > 0 and res.chunk_tokens:
            res.chunk_tokens[-1] += extra

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()


class InProcessDriver:
    """The same engine in this process, through AsyncLLMEngine (no server, no network)."""
    name = "in-process"
    in_process = True

    def __init__(self, engine_dir: str, **engine_kwargs):
        from tritium.backend.async_engine import AsyncLLMEngine
        self.engine_dir = engine_dir
        self.engine = AsyncLLMEngine(engine_dir, **engine_kwargs)

    def describe(self) -> dict:
        import torch
        return {"driver": self.name, "engine": self.engine_dir, "torch_threads": torch.get_num_threads()}

    def check(self) -> None:
        pass

    def session(self) -> "_InProcessSession":
        return _InProcessSession(self.engine)

    def close(self) -> None:
        self.engine.shutdown()


class _InProcessSession:
    def __init__(self, engine):
        self.engine = engine

    def run(self, req: BenchRequest, request_id: str) -> RequestResult:
        from tritium.backend.sampling_params import SamplingParams
        res = RequestResult(req.index, req.max_tokens, now())
        try:
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
            for out in self.engine.generate(request_id, prompt=req.prompt, params=params):
                t = now()
                if out.error:
                    res.error = out.error
                n = len(out.outputs[0].new_token_ids) if out.outputs else 0
                if n:
                    res.chunk_times.append(t)
                    res.chunk_tokens.append(n)
                res.num_prompt_tokens = len(out.prompt_token_ids)
                if out.finished:
                    res.num_output_tokens = len(out.outputs[0].token_ids) if out.outputs else 0
                    res.t_end = t
        except Exception as e:
            res.error, res.t_end = f"{type(e).__name__}: {e}", now()
        return res

    def close(self) -> None:
        pass
