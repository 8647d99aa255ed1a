"""The serving benchmark's OpenAI-compatible driver: POST /v1/completions, stream: true (SSE).

Works with llama.cpp's llama-server, vLLM and any server that streams one chunk per token.
"""
from __future__ import annotations

import http.client
import json
import urllib.parse
import urllib.request
from typing import Optional

from tritium.client.bench.bench_drivers import RequestResult, now
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
            if choice is not None:
                res.text_chars += len(choice.get("text") or "")
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
