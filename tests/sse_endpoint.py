"""A minimal OpenAI-style /v1/completions server (server-sent events) over Tritium's in-process
AsyncLLMEngine, for testing `tritium bench --openai-url` without llama-server.

It is a real endpoint: it parses the request, runs the engine, streams one `data:` chunk per
engine step (choices[0].text = the step's text delta), then a final chunk with `usage`
{prompt_tokens, completion_tokens} (as llama-server: an empty-text choice with finish_reason; or
as vLLM: no choice), then `data: [DONE]`. It records every request body
and, per request, the perf_counter times at which it received it and wrote each chunk (the same
clock as the benchmark's, since both run in the test process). `short_by` > 0 makes it stop that
many tokens early (a server that ends before max_tokens) so the mismatch report can be tested.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tritium.backend.async_engine import AsyncLLMEngine
from tritium.backend.sampling_params import SamplingParams


class SSEEndpoint:
    def __init__(self, engine_dir: str, model: str = "tiny", short_by: int = 0, closing: str = "llama"):
        self.engine = AsyncLLMEngine(engine_dir, device="cpu")
        self.model, self.short_by, self.closing = model, short_by, closing
        self.bodies, self.log = [], {}  # log: prompt -> {"received": t, "writes": [t, ...]}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.shutdown()

    def _handler(self):
        ep = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, chunked streaming

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path != "/v1/models":
                    return self._send_json(404, {"error": "not found"})
                self._send_json(200, {"object": "list", "data": [{"id": ep.model, "object": "model"}]})

            def do_POST(self):
                t_recv = time.perf_counter()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with ep.lock:
                    ep.bodies.append(body)
                if self.path != "/v1/completions" or body.get("model") != ep.model:
                    return self._send_json(404, {"error": f"no model {body.get('model')!r} at {self.path}"})
                params = SamplingParams(max_tokens=body["max_tokens"] - ep.short_by,
                                        temperature=float(body.get("temperature", 1.0)),
                                        ignore_eos=bool(body.get("ignore_eos", False)))
                writes = []
                with ep.lock:
                    ep.log[body["prompt"]] = {"received": t_recv, "writes": writes}
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                rid = f"sse-{id(writes):x}"
                final = None
                for out in ep.engine.generate(rid, prompt=body["prompt"], params=params):
                    c = out.outputs[0]
                    if c.new_token_ids:
                        writes.append(time.perf_counter())  # stamped before the bytes leave
                        self._event({"id": rid, "object": "text_completion", "model": ep.model,
                                     "choices": [{"index": 0, "text": c.text_delta, "finish_reason": None}]})
                    final = out
                usage = {"prompt_tokens": len(final.prompt_token_ids),
                         "completion_tokens": len(final.outputs[0].token_ids)}
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                # The final chunk carries no new token: llama-server sends an empty-text choice with
                # finish_reason, vLLM's usage chunk has no choices.
                choices = [{"index": 0, "text": "", "finish_reason": final.outputs[0].finish_reason}] \
                    if ep.closing == "llama" else []
                self._event({"id": rid, "object": "text_completion", "model": ep.model, "choices": choices,
                             "usage": usage})
                self._write(b"data: [DONE]\n\n")
                self._write(b"")

            def _event(self, d):
                self._write(b"data: " + json.dumps(d).encode() + b"\n\n")

            def _write(self, data: bytes):
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _send_json(self, code, d):
                raw = json.dumps(d).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)
        return Handler
