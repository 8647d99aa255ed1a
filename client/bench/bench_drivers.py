"""How the serving benchmark talks to a system: Triton gRPC streaming and in-process (OpenAI SSE:
bench_openai.py).

Every driver gives each benchmark worker thread its own session (a gRPC stream, a keep-alive
HTTP connection, or a stream of the in-process AsyncLLMEngine) and returns one RequestResult per
request: the send time, the arrival time and token count of every streamed chunk, the end time
and the token counts the system reported. All requests are greedy with EOS ignored, so every
system generates exactly `max_tokens` tokens; a different count is reported as a mismatch.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from tritium.client.bench.bench_workload import BenchRequest

# The outputs the Triton driver asks for: those it reads from every response (each output of a
# response costs the backend a tensor, tritonserver a copy and gRPC a field; docs/serving.md).
# The text is read too: a streaming user wants it, and llama-server's SSE events carry it, so
# both systems of a comparison deliver and decode the same per-token payload.
REQUESTED_OUTPUTS = ("output_ids", "text_output", "num_input_tokens", "num_output_tokens")

now = time.perf_counter


def greedy_stream_inputs(grpcclient, prompt: str, max_tokens: int) -> list:
    """tritonclient inputs of one streamed greedy request of exactly max_tokens tokens (EOS ignored)."""
    arrays = {"text_input": ("BYTES", np.array([[prompt.encode("utf-8")]], dtype=np.object_)),
              "max_tokens": ("INT32", np.array([[max_tokens]], dtype=np.int32)),
              "stream": ("BOOL", np.array([[True]], dtype=np.bool_)),
              "temperature": ("FP32", np.array([[0.0]], dtype=np.float32)),
              # ignore_eos has no tensor of its own; vllm_backend's JSON parameters carry it.
              "sampling_parameters": ("BYTES", np.array([[b'{"ignore_eos": true}']], dtype=np.object_))}
    inputs = []
    for name, (dtype, arr) in arrays.items():
        inp = grpcclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


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
    text_chars: int = 0                                      # characters of text received
    token_ids: Optional[List[int]] = None                    # every token id, when the driver keeps them
    error: Optional[str] = None
    probe_gbs: Optional[List[float]] = None                  # host read GB/s just before / after (bandwidth_probe)
    probe_watch: Optional[List[dict]] = None                 # those probes' waits and watched CPU (ReadProbe.last_record)

    @property
    def output_tokens(self) -> int:
        return self.num_output_tokens if self.num_output_tokens is not None else sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.t_end is not None


class TritonGrpcDriver:
    """Tritium's LLM model on tritonserver, through tritonclient's gRPC bidirectional stream (one
    for all the driver's sessions: _SharedStream)."""
    name = "triton-grpc"
    in_process = False

    def __init__(self, url: str, model: str, timeout: float = 600.0, keep_token_ids: bool = False,
                 api_key: Optional[str] = None):
        from tritium.client.security import key_headers
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.model = model
        self.timeout = timeout
        self.keep_token_ids = keep_token_ids  # RequestResult.token_ids too (for tests)
        self.headers = key_headers(api_key, "grpc") or None  # the server's API key, if any
        self._lock = threading.Lock()
        self._stream: Optional[_SharedStream] = None  # made by the first session

    def describe(self) -> dict:
        return {"driver": self.name, "url": self.url, "model": self.model}

    def check(self) -> None:
        """Fail early, naming the flag, when the server or the model is not there."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
        try:
            with grpcclient.InferenceServerClient(self.url) as c:
                ready = c.is_model_ready(self.model, headers=self.headers)
                if ready:  # metadata is keyed like inference: a missing or wrong key fails here
                    c.get_model_metadata(self.model, headers=self.headers)
        except InferenceServerException as e:
            if "restricted" in e.message():
                raise ValueError(f"--url: the server at {self.url} refused the request ({e.message()}); give its "
                                 f"API key with --api-key KEY or $TRITIUM_API_KEY") from None
            raise OSError(f"--url {self.url}: no Triton gRPC server answers ({e.message()})") from None
        if not ready:
            raise ValueError(f"--model {self.model}: not ready on the Triton server at {self.url}")

    def session(self) -> "_TritonSession":
        with self._lock:
            if self._stream is None:
                self._stream = _SharedStream(self)
            return _TritonSession(self._stream)

    def close(self) -> None:
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()


class _SharedStream:
    """One gRPC stream for every concurrent request of a driver, as a front end would keep it: the
    bidirectional stream carries many requests at once and their responses are told apart by
    request id. Each stream costs the client a reader thread that wakes once per response; with
    one stream a step's burst of responses is read by one thread in a row (at concurrency 16 the
    client's CPU per token fell to about half of one stream per worker, docs/benchmarks.md).

    Responses are read where they arrive (tritonclient's reader thread); a request's worker is
    woken only for its final response or an error. tritonclient reports a failed request
    without its id: with one request in flight it is that one's, else every request in flight
    on the stream fails with it (a benchmark request that fails is a failed run either way)."""

    def __init__(self, drv: TritonGrpcDriver):
        import tritonclient.grpc as grpcclient
        self.drv, self.grpc = drv, grpcclient
        # What this client reads: the new token ids, their text and the counts the benchmark checks
        # (the other outputs of the contract, e.g. log probs and context ids, are not asked for).
        self._outputs = [grpcclient.InferRequestedOutput(n) for n in REQUESTED_OUTPUTS]
        self._lock = threading.Lock()
        self._pending = {}    # request id -> (RequestResult, queue of its worker)
        self._broken = False  # the stream failed: start a new one before the next request
        self.client = grpcclient.InferenceServerClient(drv.url)
        self.client.start_stream(callback=self._on_response, headers=drv.headers)

    def submit(self, req: BenchRequest, request_id: str, res: RequestResult, done: "queue.Queue") -> None:
        inputs = greedy_stream_inputs(self.grpc, req.prompt, req.max_tokens)
        with self._lock:
            if self._broken:
                try:
                    self.client.stop_stream(cancel_requests=True)
                except Exception:
                    pass
                self.client.start_stream(callback=self._on_response, headers=self.drv.headers)
                self._broken = False
            self._pending[request_id] = (res, done)
            try:
                self.client.async_stream_infer(self.drv.model, inputs, request_id=request_id,
                                               outputs=self._outputs, enable_empty_final_response=True)
            except Exception:
                del self._pending[request_id]
                raise

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def _on_response(self, result, error) -> None:
        t = now()
        if error is not None:
            with self._lock:
                failed, self._pending = list(self._pending.values()), {}
                self._broken = self._broken or error.status() is not None  # a gRPC error: the stream is gone
            for _, done in failed:
                done.put((t, str(error)))
            return
        resp = result.get_response()
        with self._lock:
            entry = self._pending.get(resp.id)  # None: a late answer to a timed-out request
        if entry is None:
            return
        res, done = entry
        try:
            if resp.outputs:
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    res.chunk_times.append(t)
                    res.chunk_tokens.append(int(ids.size))
                    if self.drv.keep_token_ids:
                        res.token_ids = (res.token_ids or []) + [int(x) for x in ids.reshape(-1)]
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    res.text_chars += len(text.reshape(-1)[0].decode("utf-8", "replace"))
                for name, attr in (("num_output_tokens", "num_output_tokens"),
                                   ("num_input_tokens", "num_prompt_tokens")):
                    a = result.as_numpy(name)
                    if a is not None and a.size:
                        setattr(res, attr, int(a.reshape(-1)[0]))
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                self.forget(resp.id)
                done.put((t, None))
        except Exception as e:  # reported by the worker as this request's error
            self.forget(resp.id)
            done.put((t, f"{type(e).__name__}: {e}"))

    def close(self) -> None:
        # Nothing is in flight here (each request returns on its final response). Cancelling a
        # stream whose requests already finished keeps tritonserver 2.51 from unloading the model
        # for 15-30 s, so a server stopped right after would exit on its timeout.
        try:
            self.client.stop_stream(cancel_requests=self._broken)
        finally:
            self.client.close()


class _TritonSession:
    """A benchmark worker's requests, one at a time, on the driver's shared stream."""

    def __init__(self, stream: _SharedStream):
        self.stream = stream
        self.done: "queue.Queue" = queue.Queue()

    def run(self, req: BenchRequest, request_id: str) -> RequestResult:
        res = RequestResult(req.index, req.max_tokens, now())
        try:
            self.stream.submit(req, request_id, res, self.done)
            t, error = self.done.get(timeout=self.stream.drv.timeout)
            res.t_end = t
            if error is not None:
                res.error = error
        except queue.Empty:
            self.stream.forget(request_id)
            res.error, res.t_end = f"no response within {self.stream.drv.timeout:.0f} s", now()
        except Exception as e:  # a broken stream must not kill the worker: count it, go on
            self.stream.forget(request_id)
            res.error, res.t_end = f"{type(e).__name__}: {e}", now()
        return res

    def close(self) -> None:
        pass


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
