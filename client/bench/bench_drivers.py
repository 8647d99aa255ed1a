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
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from tritium.client.bench.bench_workload import BenchRequest

# The outputs the Triton driver asks for (a client that streams text and counts its tokens)
REQUESTED_OUTPUTS = ("text_output", "output_ids", "num_input_tokens", "num_output_tokens")

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
        # What a streaming client reads: the text, and the counts the benchmark checks (the other
        # outputs of the contract, e.g. log probs and context ids, are not asked for).
        self._outputs = [grpcclient.InferRequestedOutput(n) for n in REQUESTED_OUTPUTS]
        self.events: "queue.Queue" = queue.Queue()
        # The callback only stamps the arrival time; decoding happens in the worker thread.
        self.client.start_stream(callback=lambda result, error: self.events.put((now(), result, error)))

    def _inputs(self, req: BenchRequest):
        return greedy_stream_inputs(self.grpc, req.prompt, req.max_tokens)

    def run(self, req: BenchRequest, request_id: str) -> RequestResult:
        res = RequestResult(req.index, req.max_tokens, now())
        try:
            self.client.async_stream_infer(self.drv.model, self._inputs(req), request_id=request_id,
                                           outputs=self._outputs, enable_empty_final_response=True)
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
        # Nothing is in flight here (each request returns on its final response). Cancelling a
        # stream whose requests already finished keeps tritonserver 2.51 from unloading the model
        # for 15-30 s, so a server stopped right after would exit on its timeout.
        try:
            self.client.stop_stream(cancel_requests=False)
        finally:
            self.client.close()


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
