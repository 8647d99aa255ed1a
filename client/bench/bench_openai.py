"""The serving benchmark's OpenAI-compatible driver: POST /v1/completions, stream: true (SSE).

Works with llama.cpp's llama-server, vLLM and any server that streams one chunk per token. The
connection and the event reading are bench_sse.py's, shared with the Triton generate_stream driver.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional

from tritium.client.bench.bench_drivers import RequestResult
from tritium.client.bench.bench_sse import SSESession, key_refused, with_key
from tritium.client.bench.bench_workload import BenchRequest


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

    def __init__(self, url: str, model: Optional[str] = None, timeout: float = 600.0,
                 api_key: Optional[str] = None):
        self.url = completions_url(url)
        self.model = model
        self.timeout = timeout
        self.headers = with_key(api_key)  # `Authorization: Bearer KEY` for a server with an API key

    def describe(self) -> dict:
        return {"driver": self.name, "url": self.url, "model": self.model}

    def check(self) -> None:
        """Resolve the model name from /v1/models when not given; fail early naming the flag."""
        models_url = self.url[: -len("/completions")] + "/models"
        try:
            with urllib.request.urlopen(urllib.request.Request(models_url, headers=self.headers), timeout=30) as r:
                data = json.loads(r.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise key_refused(e.code, "--openai-url", self.url, e.read()) from None
            if self.model is None:
                raise OSError(f"--openai-url {self.url}: GET {models_url} failed ({e}); "
                              f"is the server up? (or pass --openai-model)") from None
            return
        except (OSError, ValueError) as e:
            if self.model is None:
                raise OSError(f"--openai-url {self.url}: GET {models_url} failed ({e}); "
                              f"is the server up? (or pass --openai-model)") from None
            return
        ids = [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]
        if self.model is None:
            self.model = ids[0] if ids else "default"

    def session(self) -> SSESession:
        return SSESession(self)

    def close(self) -> None:
        pass

    def body(self, req: BenchRequest, request_id: str) -> dict:
        return {"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}

    @staticmethod
    def on_event(res: RequestResult, t: float, d: dict) -> bool:
        if "error" in d:
            res.error = str(d["error"])[:300]
            return False
        choice = (d.get("choices") or [None])[0]
        if choice is not None:
            text = choice.get("text")
            # llama-server ends with an empty-text chunk carrying finish_reason: no token in it.
            if choice.get("finish_reason") is None or text:
                res.chunk_times.append(t)
                res.chunk_tokens.append(1)
            res.text_chars += len(text or "")
        usage = d.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            res.num_output_tokens = int(usage["completion_tokens"])
            res.num_prompt_tokens = usage.get("prompt_tokens")
        return True

    @staticmethod
    def finish(res: RequestResult) -> None:
        extra = (res.num_output_tokens or 0) - sum(res.chunk_tokens)
        if extra > 0 and res.chunk_tokens:
            res.chunk_tokens[-1] += extra
