"""Responses of one Triton request row: turns the engine's RequestOutputs into decoupled responses.

The AsyncLLMEngine's delivery thread calls RowStream.on_output for every step that changed the
row (one thread for every request of the model). Responses carry only the outputs the client
asked for (all of them when it named none); the request's final flag rides on the last
response of its last (row, sample) stream.
"""
from __future__ import annotations

import threading
import time
from typing import List, Optional

import numpy as np

from tritium.backend.errors import to_wire
from tritium.backend.triton_backend.contract import (NUM_CONTEXT_IDS, OUTPUTS, logprobs_detail, response_arrays,
                                                    token_logprobs)
from tritium.backend.triton_backend.tensor_cache import MAX_INTS, MAX_TEXT_BYTES

# The outputs of a response without log probs (logprobs_detail goes out only with them).
_FAST_OUTPUTS = tuple(s.name for s in OUTPUTS if s.name != "logprobs_detail")


class RequestState:
    """Book-keeping of one Triton request (all its batch rows and samples)."""

    def __init__(self, pb_utils, request, num_streams: int, tensors=None, output_names=None):
        self.pb = pb_utils
        self.cache = tensors  # the model's TensorCache (repeated small outputs built once), or None
        self.tensor = tensors.tensor if tensors is not None else pb_utils.Tensor
        self.request = request
        self.sender = request.get_response_sender()
        self.lock = threading.Lock()
        self.remaining = num_streams   # (row, sample) streams not finished yet
        self.closed = False            # the final flag went out
        names = set(request.requested_output_names() or ())
        if output_names is not None:  # the request parameter narrows what the client named (or all)
            names = (names & output_names) if names else set(output_names)
        self.outputs = names or None   # None: every output

    def send(self, arrays: dict, stream_done: bool) -> None:
        """One response of `arrays` (built for self.outputs only: response_arrays(names=...));
        the final flag when this was the last open stream."""
        tensor = self.tensor
        self.send_tensors([tensor(k, v) for k, v in arrays.items()], stream_done)

    def send_tensors(self, tensors: list, stream_done: bool) -> None:
        """One response of these pb_utils.Tensors; the final flag when this was the last open stream."""
        pb = self.pb
        with self.lock:
            if self.closed:
                return
            if stream_done:
                self.remaining -= 1
            final = self.remaining == 0
            self.sender.send(pb.InferenceResponse(output_tensors=tensors),
                             flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            self.closed = final

    def is_cancelled(self) -> bool:
        """Whether the client cancelled. Asked under the lock, and only while the request is open:
        once its final response is out, Triton frees the request's response factory, and asking
        then crashes tritonserver 2.51 (TRITONBACKEND_ResponseFactoryIsCancelled, SIGSEGV)."""
        with self.lock:
            return not self.closed and self.request.is_cancelled()

    def close_with_error(self, msg: str) -> None:
        pb = self.pb
        with self.lock:
            if self.closed:
                return
            self.closed = True
            self.sender.send(pb.InferenceResponse(error=pb.TritonError(msg)),
                             flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close_cancelled(self) -> None:
        with self.lock:
            if not self.closed:
                self.closed = True
                self.sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class RowStream:
    """One row of a request: its samples' streams, echo, context ids and token times."""

    def __init__(self, state: RequestState, engine, metrics, tokenizer, row: int, rid: str, parsed,
                 prompt_ids: List[int], n: int, arrival: float, on_done):
        self.state, self.engine, self.metrics = state, engine, metrics
        self.row, self.rid, self.p, self.n = row, rid, parsed, n
        self.tokenizer = tokenizer
        self.num_input = len(prompt_ids)
        self.arrival = arrival
        self.on_done = on_done  # called once when the row is over (finished, failed or cancelled)
        # With exclude_input_in_output false, output_ids start with the prompt ids and
        # text_output with the prompt (tensorrtllm_backend's convention); both go out once.
        self.echo_ids = [] if parsed.exclude_input_in_output else list(prompt_ids)
        self.echo_text = "" if parsed.exclude_input_in_output else (
            parsed.prompt if parsed.prompt is not None else tokenizer.decode(prompt_ids) if tokenizer else "")
        self.sent_ids = [[] for _ in range(n)]   # ids already sent, per sample (context_ids source)
        self.done = [False] * n
        self.token_times = [[] for _ in range(n)]
        self.over = False
        # Outputs that do not change over a stream, built once per sample (responses go out per token).
        names = state.outputs
        self.want = tuple(k for k in _FAST_OUTPUTS if names is None or k in names)  # in contract order
        self.constants = [{k: np.array([[v]], dtype=np.int32)
                           for k, v in (("num_input_tokens", self.num_input), ("batch_index", row), ("sequence_index", i))
                           if names is None or k in names} for i in range(n)]

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None else ""

    def _finish(self) -> None:
        if not self.over:
            self.over = True
            self.on_done(self)

    def cancel(self) -> None:
        """The client cancelled (or another row failed): stop the engine request, close."""
        self.engine.abort(self.rid)
        self.state.close_cancelled()
        self._finish()

    def on_output(self, out) -> None:
        if self.over:
            return
        if isinstance(out, BaseException):
            self.state.close_with_error(to_wire(out))
            self._finish()
            return
        if self.state.closed:
            self.cancel()
            return
        try:
            self._emit_all(out)
        except Exception as e:  # a response that cannot be built fails this request only
            self.engine.abort(self.rid)
            self.state.close_with_error(to_wire(e))
            self._finish()

    def _emit_all(self, out) -> None:
        now = time.monotonic()
        p = self.p
        for c in out.outputs:
            i = c.index
            if self.done[i]:
                continue
            new_ids = list(c.new_token_ids or [])
            self.token_times[i].extend([now] * len(new_ids))
            finished = c.finish_reason is not None
            self.metrics.add_tokens(0, len(new_ids))
            if p.stream and (new_ids or c.text_delta or finished):
                first = not self.sent_ids[i]
                text = (self.echo_text if first else "") + (c.text_delta or "")
                out_ids = (self.echo_ids if first else []) + new_ids
                self._emit(c, text, out_ids, new_ids, self.sent_ids[i], finished)
                self.sent_ids[i].extend(out_ids)
            elif finished and not p.stream:
                self._emit(c, self.echo_text + c.text, self.echo_ids + list(c.token_ids),
                           list(c.token_ids), [], True)
            if finished:
                self.done[i] = True
                self.metrics.observe_token_times(self.arrival, self.token_times[i])
        if all(self.done):
            self.metrics.add_tokens(self.num_input, 0)
            self._finish()

    def _emit(self, c, text: str, out_ids: List[int], gen_ids: List[int], prev_ids: List[int],
              finished: bool) -> None:
        """One response. out_ids: what output_ids carries; gen_ids: the generated ids among them."""
        p = self.p
        if not p.return_log_probs and self.state.cache is not None:
            self._emit_cached(c, text, out_ids, prev_ids, finished)
            return
        new_lps: List[float] = []
        cum: Optional[float] = c.cum_logprob if p.return_log_probs else None
        detail = None
        if p.return_log_probs:
            # Only this response's tokens: the last len(gen_ids) entries (a response per token
            # must not walk the whole sequence's log probs, which made a long stream quadratic).
            entries = c.logprobs or []
            k = min(len(gen_ids), len(entries))
            start = max(min(len(entries), len(c.token_ids)) - k, 0)  # entries pair with token ids in order
            entries = entries[start:start + k] if k else []
            new_lps = token_logprobs(entries, c.token_ids[start:start + k]) if k else []
            detail = logprobs_detail(entries, self._token_text)
        arrays = response_arrays(
            text=text, new_ids=out_ids, finish_reason=c.finish_reason if finished else None,
            cum_log_prob=cum, log_probs=new_lps, num_input_tokens=self.num_input,
            num_output_tokens=len(c.token_ids), batch_index=self.row, sequence_index=c.index,
            context_ids=prev_ids[-NUM_CONTEXT_IDS:], logprobs_detail=detail, names=self.state.outputs,
            constants=self.constants[c.index])
        self.state.send(arrays, stream_done=finished)

    def _emit_cached(self, c, text: str, out_ids: List[int], prev_ids: List[int], finished: bool) -> None:
        """_emit without log probs: each output's Tensor from the model's TensorCache, looked up
        by its value; only those not cached are built (from response_arrays, the contract's one
        builder)."""
        cache = self.state.cache
        tensors, arrays = [], None
        for name in self.want:
            if name == "text_output":
                v = text.encode("utf-8")
                v = v if len(v) <= MAX_TEXT_BYTES else None
            elif name == "output_ids":
                v = tuple(out_ids) if len(out_ids) <= MAX_INTS else None
            elif name == "num_output_tokens":
                v = (len(c.token_ids),)
            elif name == "num_input_tokens":
                v = (self.num_input,)
            elif name == "finish_reason":
                v = c.finish_reason.encode() if finished and c.finish_reason else b""
            elif name == "context_ids":
                ctx = prev_ids[-NUM_CONTEXT_IDS:]
                v = tuple(ctx) if len(ctx) <= MAX_INTS else None
            elif name == "batch_index":
                v = (self.row,)
            elif name == "sequence_index":
                v = (c.index,)
            else:  # cum_log_probs, output_log_probs: constant without log probs ([[0.0]], empty)
                v = ()
            key = None if v is None else (name, v)
            t = None if key is None else cache.cached(key)
            if t is None:
                if arrays is None:
                    arrays = response_arrays(
                        text=text, new_ids=out_ids, finish_reason=c.finish_reason if finished else None,
                        cum_log_prob=None, log_probs=[], num_input_tokens=self.num_input,
                        num_output_tokens=len(c.token_ids), batch_index=self.row, sequence_index=c.index,
                        context_ids=prev_ids[-NUM_CONTEXT_IDS:], names=self.state.outputs,
                        constants=self.constants[c.index])
                t = cache.add(key, name, arrays[name])
            tensors.append(t)
        self.state.send_tensors(tensors, stream_done=finished)
