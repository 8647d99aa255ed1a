"""Shape Triton's streamed Chunks into OpenAI answers: whole objects or `chat.completion.chunk` /
`text_completion` stream chunks, with `usage` and logprobs in the API's formats.

Choice index = prompt index * n + sample index (the API's order for several prompts with n > 1).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from tritium.client.openai.openai_protocol import ParsedRequest
from tritium.client.openai.openai_tools import call_deltas, held_from, parse_calls
from tritium.client.triton_client import Chunk

# The backend's finish reasons -> the API's ("abort" only reaches a client that is gone).
# "grammar_dead_end" (structured outputs: no token was allowed) goes out as it is.
_FINISH = {"stop": "stop", "length": "length", "abort": "stop"}


@dataclass
class _Choice:
    text: str = ""
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    logprobs: List[dict] = field(default_factory=list)   # logprobs_detail entries
    started: bool = False                                 # chat: the role delta went out
    offset: int = 0                                       # completions: text_offset of the next token
    sent: int = 0                                         # chat with tools: characters of text streamed


def _bytes(t: str) -> List[int]:
    return list(t.encode("utf-8"))


class AnswerBuilder:
    """Accumulates the Chunks of one OpenAI request; builds the stream chunks and the final answer."""

    def __init__(self, req: ParsedRequest):
        self.req = req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.choices: Dict[int, _Choice] = {}
        self.prompt_tokens: Dict[int, int] = {}
        for p in range(len(req.requests)):
            for s in range(req.n):
                c = _Choice()
                echo = req.echo_prompts[p] if req.echo_prompts else None
                if echo:
                    c.text, c.offset = echo, len(echo)
                self.choices[p * req.n + s] = c

    # ---- accumulate ---------------------------------------------------------------------
    def add(self, prompt_index: int, chunk: Chunk) -> int:
        """Record one Chunk; returns its choice index."""
        idx = prompt_index * self.req.n + chunk.sequence_index
        c = self.choices[idx]
        c.text += chunk.text
        if chunk.num_output_tokens is not None:
            c.completion_tokens = chunk.num_output_tokens
        if chunk.num_input_tokens is not None:
            self.prompt_tokens[prompt_index] = chunk.num_input_tokens
        if chunk.finish_reason:
            c.finish_reason = _FINISH.get(chunk.finish_reason, chunk.finish_reason)
        c.logprobs.extend(chunk.logprobs_detail)
        return idx

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.completion_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- logprobs formats -----------------------------------------------------------------
    def _chat_logprobs(self, entries: List[dict]) -> Optional[dict]:
        if self.req.logprobs is None:
            return None
        return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])}
                                              for t in e.get("top", [])]} for e in entries]}

    def _completion_logprobs(self, entries: List[dict], c: _Choice) -> Optional[dict]:
        if self.req.logprobs is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(c.offset)
            c.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top", [])} for e in entries],
                "text_offset": offsets}

    # ---- streaming --------------------------------------------------------------------------
    def _chunk(self, choices: list, usage=None) -> dict:
        d = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": self.created, "model": self.req.model, "choices": choices}
        if self.chat:
            d["system_fingerprint"] = None
        if self.req.include_usage:
            d["usage"] = usage
        return d

    def first_chunks(self) -> List[dict]:
        """Completions with echo: the prompt text first, as its own chunk per choice."""
        out = []
        if not self.chat:
            for idx, c in self.choices.items():
                if c.text:
                    out.append(self._chunk([{"index": idx, "text": c.text, "logprobs": None, "finish_reason": None}]))
        return out

    def stream_chunks(self, prompt_index: int, chunk: Chunk) -> List[dict]:
        """The stream chunks for one Triton Chunk (after add())."""
        idx = prompt_index * self.req.n + chunk.sequence_index
        c = self.choices[idx]
        out = []
        entries = chunk.logprobs_detail
        if self.chat:
            if not c.started:
                c.started = True
                out.append(self._chunk([{"index": idx, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]))
            text = chunk.text
            if self.req.tools is not None:  # a call is held back until it is whole (openai_tools.held_from)
                upto = len(c.text) if chunk.finish_reason else max(c.sent, held_from(c.text, self.req.tools))
                calls = parse_calls(c.text, self.req.tools)[1] if chunk.finish_reason else []
                if calls:
                    upto = c.sent
                text, c.sent = c.text[c.sent:upto], upto
            if text or entries:
                out.append(self._chunk([{"index": idx, "delta": {"content": text},
                                         "logprobs": self._chat_logprobs(entries), "finish_reason": None}]))
            if chunk.finish_reason:
                finish = c.finish_reason
                if self.req.tools is not None and calls:
                    out += [self._chunk([{"index": idx, "delta": d, "logprobs": None, "finish_reason": None}])
                            for d in call_deltas(calls)]
                    finish = "tool_calls"
                out.append(self._chunk([{"index": idx, "delta": {}, "logprobs": None, "finish_reason": finish}]))
        else:
            if chunk.text or entries or chunk.finish_reason:
                out.append(self._chunk([{"index": idx, "text": chunk.text,
                                         "logprobs": self._completion_logprobs(entries, c),
                                         "finish_reason": c.finish_reason if chunk.finish_reason else None}]))
        return out

    def usage_chunk(self) -> Optional[dict]:
        """The last chunk (choices []) with usage, when stream_options.include_usage asked for it."""
        if not self.req.include_usage:
            return None
        return self._chunk([], usage=self.usage())

    # ---- whole answer -------------------------------------------------------------------------
    def answer(self) -> dict:
        choices = []
        for idx in sorted(self.choices):
            c = self.choices[idx]
            if self.chat:
                msg, finish = {"role": "assistant", "content": c.text}, c.finish_reason
                if self.req.tools is not None:
                    content, calls = parse_calls(c.text, self.req.tools)
                    if calls:
                        msg, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
                choices.append({"index": idx, "message": msg, "logprobs": self._chat_logprobs(c.logprobs),
                                "finish_reason": finish})
            else:
                echo = self.req.echo_prompts[idx // self.req.n] if self.req.echo_prompts else None
                c.offset = len(echo) if echo else 0
                choices.append({"index": idx, "text": c.text,
                                "logprobs": self._completion_logprobs(c.logprobs, c),
                                "finish_reason": c.finish_reason})
        d = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
             "created": self.created, "model": self.req.model, "choices": choices, "usage": self.usage()}
        if self.chat:
            d["system_fingerprint"] = None
        return d
