"""A small Python client for Tritium models on tritonserver, over tritonclient gRPC or HTTP.

    from tritium.client.triton_client import TritiumClient
    c = TritiumClient("127.0.0.1:8001", protocol="grpc", model="smollm2")
    print(c.generate("Hello", max_tokens=32, temperature=0).text)
    for chunk in c.stream("Hello", max_tokens=32):
        print(chunk.text, end="", flush=True)

gRPC uses tritonclient's bidirectional stream (the only way to talk to a decoupled model);
HTTP uses Triton's generate / generate_stream (server-sent events) endpoints. Both speak the
tensor contract of tritium.backend.triton_backend.contract, so they work with the NAME, NAME_ensemble
and NAME_bls models alike.
"""
from __future__ import annotations

import json
import os
import queue
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import numpy as np

from tritium.backend.errors import from_wire
from tritium.backend.triton_backend.contract import INPUTS

_SPEC = {s.name: s for s in INPUTS}
_NP = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_BOOL": np.bool_,
       "TYPE_UINT64": np.uint64, "TYPE_FP16": np.float16}
_WIRE = {"TYPE_STRING": "BYTES", "TYPE_INT32": "INT32", "TYPE_FP32": "FP32", "TYPE_BOOL": "BOOL",
         "TYPE_UINT64": "UINT64", "TYPE_FP16": "FP16"}


class TritiumClientError(RuntimeError):
    """The server answered with an error: `code` (backend/errors.py CODES), `field` (the request
    field it names, or None) and the message."""

    def __init__(self, wire_message: str):
        err = from_wire(wire_message)
        super().__init__(err.message)
        self.code, self.field, self.message = err.code, err.field, err.message


class TritonUnreachableError(ConnectionError):
    """tritonserver did not answer (its message says where it was looked for)."""


@dataclass
class Chunk:
    """One streamed response: the new text and ids, and finish_reason on the last one."""
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    num_input_tokens: Optional[int] = None
    num_output_tokens: Optional[int] = None
    log_probs: List[float] = field(default_factory=list)
    cum_log_prob: Optional[float] = None
    sequence_index: int = 0
    # per new token {"id", "token", "logprob", "top": [...]}, when logprobs were asked for
    logprobs_detail: List[dict] = field(default_factory=list)


@dataclass
class Completion:
    """One sample's whole answer."""
    text: str
    token_ids: List[int]
    finish_reason: Optional[str]
    num_input_tokens: Optional[int] = None
    num_output_tokens: Optional[int] = None
    log_probs: List[float] = field(default_factory=list)
    cum_log_prob: Optional[float] = None
    index: int = 0


def build_request(prompt: Optional[str] = None, **params) -> dict:
    """Validated {input name: value} from keyword parameters (names of the tensor contract;
    `guided=GuidedDecodingParams(...)` fills guided_decoding_guide_type / guided_decoding_guide)."""
    if params.get("guided") is not None:
        from tritium.backend.guided.surfaces import to_tensors
        params.update(to_tensors(params["guided"].validate()))
    params.pop("guided", None)
    req = {}
    if prompt is not None:
        req["text_input"] = prompt
    for k, v in params.items():
        if v is None:
            continue
        if k not in _SPEC:
            raise ValueError(f"unknown parameter {k!r}; allowed: {', '.join(sorted(_SPEC))}")
        req[k] = v
    return req


def _as_array(name: str, value) -> np.ndarray:
    spec = _SPEC[name]
    dtype = _NP[spec.data_type]
    if spec.dims == (1,):
        value = [value]
    if dtype is np.object_:
        arr = np.array([[v.encode("utf-8") if isinstance(v, str) else v for v in value]], dtype=np.object_)
    else:
        arr = np.array([value], dtype=dtype)
    return arr


def grpc_inputs(req: dict, grpc_module) -> list:
    """InferInputs of tritonclient.grpc (or .grpc.aio: pass the module) for a build_request() dict."""
    inputs = []
    for name, value in req.items():
        arr = _as_array(name, value)
        inp = grpc_module.InferInput(name, list(arr.shape), _WIRE[_SPEC[name].data_type])
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    return inputs


# The outputs a Chunk reads without log probs, asked for by name (batch_index and context_ids are
# for stateless postprocessors): each output of a response is a tensor the backend builds and
# tritonserver, gRPC and this client carry per token. A request for log probs asks for every
# output (an ensemble has no logprobs_detail, so it cannot be named).
READ_OUTPUTS = ("text_output", "output_ids", "finish_reason", "num_input_tokens", "num_output_tokens",
                "cum_log_probs", "sequence_index")


def wants_log_probs(req: dict) -> bool:
    """Whether a build_request() dict asks for log probs (return_log_probs, or sampling_parameters'
    logprobs)."""
    if req.get("return_log_probs"):
        return True
    sp = req.get("sampling_parameters")
    if sp:
        try:
            d = json.loads(sp)
        except ValueError:
            return True  # the server names the error; ask for everything meanwhile
        return not isinstance(d, dict) or d.get("logprobs") is not None
    return False


def chunk_from_result(result) -> Chunk:
    """A Chunk from one tritonclient InferResult."""
    return _chunk_from_arrays(result.as_numpy)


def _chunk_from_arrays(get) -> Chunk:
    def scalar(name, conv):
        a = get(name)
        return None if a is None or a.size == 0 else conv(a.reshape(-1)[0])
    text = scalar("text_output", lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v)) or ""
    ids = get("output_ids")
    lps = get("output_log_probs")
    fr = scalar("finish_reason", lambda v: v.decode() if isinstance(v, bytes) else str(v))
    detail = scalar("logprobs_detail", lambda v: json.loads(v.decode("utf-8") if isinstance(v, bytes) else v))
    return Chunk(text=text, token_ids=[] if ids is None else [int(x) for x in ids.reshape(-1)],
                 finish_reason=fr or None, num_input_tokens=scalar("num_input_tokens", int),
                 num_output_tokens=scalar("num_output_tokens", int),
                 log_probs=[] if lps is None else [float(x) for x in lps.reshape(-1)],
                 cum_log_prob=scalar("cum_log_probs", float), sequence_index=scalar("sequence_index", int) or 0,
                 logprobs_detail=detail or [])


class TritiumClient:
    """Generate text from a Tritium model over gRPC (default) or HTTP. `api_key` (default
    $TRITIUM_API_KEY) is sent as the server's API key; `tls_ca`: TLS, trusting this PEM file."""

    def __init__(self, url: str = "127.0.0.1:8001", protocol: str = "grpc", model: str = "tritium",
                 timeout: float = 600.0, api_key: Optional[str] = None, tls_ca: Optional[str] = None):
        from tritium.client.security import API_KEY_ENV, key_headers
        if protocol not in ("grpc", "http"):
            raise ValueError(f"protocol must be grpc or http, got {protocol!r}")
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.protocol = protocol
        self.model = model
        self.timeout = timeout
        self.tls_ca = tls_ca
        self.headers = key_headers(api_key if api_key is not None else os.environ.get(API_KEY_ENV), protocol)
        self._output_names: Optional[bool] = None  # HTTP: whether to name the outputs (_names_outputs)

    def _grpc_client(self):
        import tritonclient.grpc as grpcclient
        from tritium.client.security import grpc_tls_kwargs
        return grpcclient.InferenceServerClient(self.url, **grpc_tls_kwargs(self.tls_ca))

    def _urlopen(self, path: str, data: Optional[bytes] = None, timeout: Optional[float] = None):
        import ssl
        headers = dict(self.headers, **({"Content-Type": "application/json"} if data is not None else {}))
        scheme, ctx = ("https", ssl.create_default_context(cafile=self.tls_ca)) if self.tls_ca else ("http", None)
        r = urllib.request.Request(f"{scheme}://{self.url}{path}", data=data, headers=headers)
        return urllib.request.urlopen(r, timeout=timeout or self.timeout, context=ctx)

    # ---- public API ------------------------------------------------------------------------
    def stream(self, prompt: Optional[str] = None, **params) -> Iterator[Chunk]:
        """Yield one Chunk per streamed response (stream=True is set for you)."""
        params["stream"] = True
        req = build_request(prompt, **params)
        yield from (self._grpc(req) if self.protocol == "grpc" else self._http(req, stream=True))

    def generate(self, prompt: Optional[str] = None, **params) -> Completion:
        """One complete answer (stream=False): text, token ids, finish_reason, counts, logprobs."""
        params["stream"] = False
        req = build_request(prompt, **params)
        chunks = list(self._grpc(req) if self.protocol == "grpc" else self._http(req, stream=False))
        return join_chunks(chunks)

    def generate_all(self, prompt: Optional[str] = None, **params) -> List[Completion]:
        """Like generate(), one Completion per sample (num_return_sequences), in sample order."""
        params["stream"] = False
        req = build_request(prompt, **params)
        chunks = list(self._grpc(req) if self.protocol == "grpc" else self._http(req, stream=False))
        indices = sorted({c.sequence_index for c in chunks}) or [0]
        return [join_chunks(chunks, i) for i in indices]

    def is_ready(self) -> bool:
        if self.protocol == "grpc":
            with self._grpc_client() as c:
                return c.is_model_ready(self.model)
        try:
            with self._urlopen(f"/v2/models/{self.model}/ready", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    # ---- gRPC --------------------------------------------------------------------------------
    def _grpc(self, req: dict) -> Iterator[Chunk]:
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException
        inputs = grpc_inputs(req, grpcclient)
        outputs = None if wants_log_probs(req) else [grpcclient.InferRequestedOutput(n) for n in READ_OUTPUTS]
        results: "queue.Queue" = queue.Queue()
        client = self._grpc_client()
        done = False
        try:
            client.start_stream(callback=lambda result, error: results.put((result, error)),
                                stream_timeout=self.timeout, headers=self.headers)
            try:
                client.async_stream_infer(self.model, inputs, request_id=uuid.uuid4().hex, outputs=outputs,
                                          enable_empty_final_response=True)
            except InferenceServerException as e:
                # The stream already failed (e.g. nothing listens at the URL): its callback holds the cause.
                try:
                    _, error = results.get(timeout=5)
                except queue.Empty:
                    error = e
                raise self._grpc_error(error) from None
            while True:
                result, error = results.get(timeout=self.timeout)
                if error is not None:
                    raise self._grpc_error(error)
                resp = result.get_response()
                final = resp.parameters.get("triton_final_response")
                if resp.outputs:
                    yield _chunk_from_arrays(result.as_numpy)
                if final is not None and final.bool_param:
                    done = True
                    return
        finally:
            # Closing early (a consumer that stops iterating) cancels the request on the server.
            client.stop_stream(cancel_requests=not done)
            client.close()

    def _grpc_error(self, error) -> Exception:
        """TritonUnreachableError when the server cannot be reached, else TritiumClientError."""
        from tritonclient.utils import InferenceServerException
        if not isinstance(error, InferenceServerException):
            return TritiumClientError(str(error))
        if "UNAVAILABLE" in str(error.status() or "") and "protocol is restricted" not in error.message():
            return TritonUnreachableError(f"cannot reach tritonserver at {self.url} (grpc): {error.message()}")
        return TritiumClientError(error.message())

    # ---- HTTP --------------------------------------------------------------------------------
    def _names_outputs(self) -> bool:
        """Whether HTTP requests may carry `output_names`: not for an ensemble, which hands its
        request parameters to its steps, so the LLM step would drop the outputs (context_ids,
        batch_index, ...) its postprocessing step decodes with. Asked once (the model's metadata,
        `platform`); when the metadata cannot be read, no (every output, as without it)."""
        if self._output_names is None:
            try:
                with self._urlopen(f"/v2/models/{self.model}", timeout=30) as r:
                    self._output_names = json.loads(r.read().decode("utf-8")).get("platform") != "ensemble"
            except (OSError, ValueError, AttributeError):
                self._output_names = False
        return self._output_names

    def _http(self, req: dict, stream: bool) -> Iterator[Chunk]:
        # /generate takes exactly one response; several samples come as several responses.
        n = req.get("num_return_sequences") or json.loads(req.get("sampling_parameters") or "{}").get("n") or 1
        sse = stream or int(n) > 1
        endpoint = "generate_stream" if sse else "generate"
        body = json.dumps(http_body(req) if self._names_outputs() else req).encode("utf-8")
        try:
            resp = self._urlopen(f"/v2/models/{self.model}/{endpoint}", data=body)
        except urllib.error.HTTPError as e:
            raise TritiumClientError(_http_error(e.read())) from None
        with resp:
            if not sse:
                d = json.loads(resp.read().decode("utf-8"))
                if "error" in d:
                    raise TritiumClientError(d["error"])
                yield _chunk_from_json(d)
                return
            for raw in resp:  # server-sent events: "data: {...}" lines
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                d = json.loads(line[5:])
                if "error" in d:
                    raise TritiumClientError(d["error"])
                yield _chunk_from_json(d)


def http_body(req: dict) -> dict:
    """The generate / generate_stream body of a build_request() dict for a NAME or NAME_bls model:
    the request, and without log probs the request parameter `output_names` naming READ_OUTPUTS
    (the generate extension cannot name outputs; a body field that is not an input becomes a
    request parameter, serving.md), so each response carries what a Chunk reads, as on gRPC."""
    return req if wants_log_probs(req) else dict(req, output_names=",".join(READ_OUTPUTS))


def _http_error(raw: bytes) -> str:
    try:
        return json.loads(raw.decode("utf-8")).get("error", raw.decode("utf-8", "replace"))
    except (ValueError, AttributeError):
        return raw.decode("utf-8", "replace")


def _chunk_from_json(d: dict) -> Chunk:
    def get(name):
        return None if name not in d else np.array(d[name], dtype=np.object_ if isinstance(d[name], str) else None)
    return _chunk_from_arrays(get)


def join_chunks(chunks: List[Chunk], sequence_index: int = 0) -> Completion:
    """Concatenate the chunks of one sample (sequence_index) into one Completion."""
    mine = [c for c in chunks if c.sequence_index == sequence_index]
    last = mine[-1] if mine else Chunk("", [])
    return Completion(text="".join(c.text for c in mine), token_ids=[t for c in mine for t in c.token_ids],
                      finish_reason=last.finish_reason, num_input_tokens=last.num_input_tokens,
                      num_output_tokens=last.num_output_tokens,
                      log_probs=[x for c in mine for x in c.log_probs], cum_log_prob=last.cum_log_prob,
                      index=sequence_index)
