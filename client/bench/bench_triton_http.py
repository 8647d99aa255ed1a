"""The serving benchmark's Triton HTTP driver: Triton's generate extension, POST
/v2/models/<model>/generate_stream (server-sent events), read by the same SSE client as the
OpenAI driver (bench_sse.py): one keep-alive connection per benchmark worker, one readline and one
json.loads per response.

tritonserver 2.51 turns each top-level field of the body into an input tensor of the Tritium
contract (a scalar for the [1]-shaped inputs; the batch dimension of max_batch_size is its own),
sends one `data: {...}` event per response of the decoupled model with every output as a field
(output_ids a number for one token, a list for several; text_output; num_input_tokens /
num_output_tokens), an event `{"error": "..."}` for a request the model refuses, and ends the
body after the final response (the empty final response itself sends no event). The generate
extension cannot name outputs; a body field that is not an input becomes a request parameter,
so the driver sends Tritium's `output_names` parameter: the four outputs it reads, as the gRPC
driver names them (REQUESTED_OUTPUTS); not to an ensemble (NAME_ensemble), which hands request
parameters to its steps: the LLM step would drop the outputs its postprocessing step decodes with
(check() reads the model's platform from its metadata).
"""
from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Optional

from tritium.client.bench.bench_drivers import REQUESTED_OUTPUTS, RequestResult
from tritium.client.bench.bench_sse import SSESession, error_text, key_refused, with_key
from tritium.client.bench.bench_workload import BenchRequest


def generate_stream_url(url: str, model: str) -> str:
    """HOST:PORT or http(s)://HOST:PORT -> that server's generate_stream URL of `model`."""
    if "://" not in url:
        url = "http://" + url
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.netloc or u.path.strip("/"):
        raise ValueError(f"--url with --triton-protocol http must be [http(s)://]HOST:PORT of tritonserver's "
                         f"HTTP service, got {url!r}")
    return f"{u.scheme}://{u.netloc}/v2/models/{urllib.parse.quote(model, safe='')}/generate_stream"


OUTPUT_NAMES = ",".join(REQUESTED_OUTPUTS)


class TritonHttpDriver:
    """Tritium's LLM model on tritonserver, through Triton's HTTP generate_stream endpoint.

    Sends the greedy request of the gRPC driver (text_input, max_tokens, stream, temperature 0,
    sampling_parameters {"ignore_eos": true}); counts the tokens of each event's output_ids and
    takes the counts the last event reports. keep_token_ids: also keep every token id
    (RequestResult.token_ids; for tests)."""
    name = "triton-http"
    in_process = False

    def __init__(self, url: str, model: str, timeout: float = 600.0, keep_token_ids: bool = False,
                 api_key: Optional[str] = None):
        self.url = generate_stream_url(url, model)
        self.model = model
        self.timeout = timeout
        self.keep_token_ids = keep_token_ids
        self.headers = with_key(api_key)  # the server's API key (tritium serve --api-key), if any
        self.name_outputs = True  # send output_names (check(): not to an ensemble)

    def describe(self) -> dict:
        return {"driver": self.name, "url": self.url, "model": self.model}

    def check(self) -> None:
        """Fail early, naming the flag, when the server or the model is not there, or the server
        refuses the API key (the model's metadata is keyed like inference; readiness is not)."""
        u = urllib.parse.urlsplit(self.url)
        conn_cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        model_path = u.path[: -len("/generate_stream")]
        for path in (model_path + "/ready", model_path):
            conn = conn_cls(u.netloc, timeout=30)
            try:
                conn.request("GET", path, headers=self.headers)
                r = conn.getresponse()
                body = r.read()
            except OSError as e:
                raise OSError(f"--url {u.netloc}: no Triton HTTP server answers ({e})") from None
            finally:
                conn.close()
            if r.status in (401, 403):
                raise key_refused(r.status, "--url", u.netloc, body)
            if r.status != 200:
                raise ValueError(f"--model {self.model}: not ready on the Triton server at {u.netloc} "
                                 f"(HTTP {r.status}: {error_text(body)[:200]})")
        try:  # an ensemble hands request parameters to its steps: output_names would starve its postprocessing
            self.name_outputs = json.loads(body.decode("utf-8")).get("platform") != "ensemble"
        except (ValueError, AttributeError):
            self.name_outputs = False

    def session(self) -> SSESession:
        return SSESession(self)

    def close(self) -> None:
        pass

    def body(self, req: BenchRequest, request_id: str) -> dict:
        body = {"id": request_id, "text_input": req.prompt, "max_tokens": req.max_tokens, "stream": True,
                "temperature": 0.0, "sampling_parameters": '{"ignore_eos": true}'}
        if self.name_outputs:
            body["output_names"] = OUTPUT_NAMES
        return body

    def on_event(self, res: RequestResult, t: float, d: dict) -> bool:
        if "error" in d:
            res.error = str(d["error"])[:300]
            return False
        ids = d.get("output_ids")
        if ids is not None:
            ids = ids if isinstance(ids, list) else [ids]
            if ids:
                res.chunk_times.append(t)
                res.chunk_tokens.append(len(ids))
                if self.keep_token_ids:
                    res.token_ids = (res.token_ids or []) + [int(x) for x in ids]
        text = d.get("text_output")
        if text:
            res.text_chars += len(text)
        n_out, n_in = d.get("num_output_tokens"), d.get("num_input_tokens")
        if n_out is not None:
            res.num_output_tokens = int(n_out)
        if n_in is not None:
            res.num_prompt_tokens = int(n_in)
        return True

    @staticmethod
    def finish(res: RequestResult) -> None:
        pass


def make_triton_driver(protocol: str, grpc_or_http_url: str, model: str, timeout: float = 600.0,
                       api_key: Optional[str] = None):
    """The Triton driver of `protocol` ("grpc" or "http"; --triton-protocol) at that URL, sending
    `api_key` (the server's --api-key) when given."""
    if protocol == "http":
        return TritonHttpDriver(grpc_or_http_url, model, timeout, api_key=api_key)
    if protocol == "grpc":
        from tritium.client.bench.bench_drivers import TritonGrpcDriver
        return TritonGrpcDriver(grpc_or_http_url, model, timeout, api_key=api_key)
    raise ValueError(f"--triton-protocol must be grpc or http, got {protocol!r}")


