"""Request / Sequence state and the RequestOutput objects the engine returns.

A Request holds `n` Sequences (one per parallel sample). Sequence 0 prefills the prompt; when its
prompt is done, the other n - 1 are forked from it and share its KV blocks (copy-on-write).
Each Sequence tracks `num_computed_tokens` (tokens whose K/V are in the cache) against
`num_tokens` (prompt + generated); the scheduler spends its token budget on the difference.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from .bad_words import BadWordsIndex
from .random_stream import SeedStream
from .sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # in the waiting queue (new, or preempted and to be recomputed)
    RUNNING = "running"    # holds KV blocks and is scheduled each step
    PENDING_FORK = "pending_fork"  # sample i > 0 waiting for sequence 0 to finish the prompt
    FINISHED = "finished"


class Sequence:
    """One token stream: the prompt plus the tokens generated so far for sample `index`."""

    def __init__(self, request: "Request", index: int, generator: Optional[SeedStream]):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids: List[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: List[int] = []
        self.block_hashes: List[bytes] = []
        self.status = SequenceStatus.WAITING if index == 0 else SequenceStatus.PENDING_FORK
        self.generator = generator
        self.finish_reason: Optional[str] = None  # None | "stop" | "length" | "abort" | "grammar_dead_end"
        self.stop_reason = None                   # the stop string or token id that ended it
        self.logprobs: Optional[List[dict]] = [] if request.params.logprobs is not None else None
        self.cum_logprob = 0.0
        self.detok = None                          # IncrementalDetokenizer, set by the engine
        self.unreported_token_ids: List[int] = []    # tokens appended since the last output
        # Speculative decoding: tokens proposed for this step (computed after token_ids, verified in
        # postprocess, never part of token_ids) and the draft's probabilities for them (k, V) or None.
        self.spec_token_ids: List[int] = []
        self.spec_draft_probs: Optional[torch.Tensor] = None
        self.guide = None  # guided.state.GuideState of a constrained request (set by the engine)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> List[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, tok: int, entry: Optional[dict], now: float, max_seq_len: int) -> Optional[str]:
        """Append a sampled token (and its logprob entry); returns the finish reason it causes:
        "stop" (EOS, a stop id, a stop string once min_tokens are out), "length", or None."""
        req, p = self.request, self.request.params
        self.token_ids.append(tok)
        self.unreported_token_ids.append(tok)
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_output_tokens += 1
        if entry is not None:
            self.logprobs.append(entry)
            self.cum_logprob += entry["logprob"]
        if tok in req.eos_token_ids or tok in req.stop_token_ids:
            self.stop_reason = tok  # reported in token_ids, but contributes no text
            return "stop"
        if self.detok is not None:
            stop = self.detok.add_tokens([tok], check_stop=self.num_output_tokens >= p.min_tokens)
            if stop is not None:
                self.stop_reason = stop
                return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= max_seq_len:
            return "length"
        return None

    def completion(self) -> "CompletionOutput":
        """This sample as of now: all text and ids, and what is new since the last call."""
        fin = self.is_finished
        delta, text = (self.detok.delta(finished=fin), self.detok.emitted_text) if self.detok is not None else ("", "")
        out = CompletionOutput(
            index=self.index, text=text, text_delta=delta, token_ids=self.output_token_ids,
            new_token_ids=self.unreported_token_ids, finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cum_logprob=self.cum_logprob if self.logprobs is not None else None)
        self.unreported_token_ids = []
        return out

    @property
    def sort_key(self):
        """Scheduling order: lower priority value first, then earlier arrival, then sample index."""
        return (self.request.priority, self.request.arrival_seq, self.index)

    def __repr__(self):
        return (f"Sequence(req={self.request.request_id!r}, idx={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")


@dataclass
class RequestMetrics:
    """Per-request timing (time.monotonic seconds) and token counts."""
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_preemptions: int = 0
    num_scheduled_tokens: int = 0  # tokens this request ran through the model (all samples, recompute included)
    num_spec_proposed_tokens: int = 0  # speculative decoding: tokens proposed and verified (all samples)
    num_spec_accepted_tokens: int = 0  # of those, accepted

    def to_dict(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        if self.first_token_time is not None:
            d["time_to_first_token"] = self.first_token_time - self.arrival_time
        return d


class Request:
    """A user request: prompt, params, priority and its n sequences."""
    _arrivals = itertools.count()

    def __init__(self, request_id: str, prompt_token_ids: List[int], params: SamplingParams,
                 priority: int = 0, eos_token_ids=(), stop_token_ids=(), bad_words_ids=()):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_seq = next(Request._arrivals)
        self.metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(prompt_token_ids))
        # Token ids that end a sequence (EOS unless ignore_eos, plus the user's stop ids).
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.bad_words_ids: List[List[int]] = [list(b) for b in bad_words_ids]
        self.bad_words = BadWordsIndex(self.bad_words_ids)
        # Banned until min_tokens are out: built once, not every step.
        ends = sorted(self.eos_token_ids | self.stop_token_ids)
        self.min_tokens_bans = torch.tensor(ends, dtype=torch.long) if ends and params.min_tokens else None
        self.lora = None  # the LoRAAdapter this request runs with (backend/lora), None for the base model
        self.seqs: List[Sequence] = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                # Sample i draws from its own stream, seeded (seed + i): the tokens depend only on
                # the seed and the sequence, never on what else shares the batch.
                gen = SeedStream(params.seed + i)
            self.seqs.append(Sequence(self, i, gen))

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def output(self) -> "RequestOutput":
        """The RequestOutput of this request as of now (each sample's new tokens since the last one)."""
        return RequestOutput(self.request_id, self.prompt_token_ids, self.is_finished,
                             [seq.completion() for seq in self.seqs], self.metrics.to_dict())


@dataclass
class CompletionOutput:
    """One sample of a request, as of this step.

    logprobs, when requested: one dict per generated token:
    {"token_id": int, "logprob": float, "top_logprobs": [{"token_id": int, "logprob": float}, ...]}
    with logprobs taken from the model's raw log-softmax (before penalties and temperature).
    """
    index: int
    text: str                 # all text so far (stop strings excluded)
    text_delta: str           # text new in this step
    token_ids: List[int]      # all generated token ids so far
    new_token_ids: List[int]  # token ids new in this step
    finish_reason: Optional[str] = None  # None | "stop" | "length" | "abort"
    stop_reason: Any = None              # the stop string / token id that matched, if any
    logprobs: Optional[List[dict]] = None
    cum_logprob: Optional[float] = None


@dataclass
class RequestOutput:
    """What step() reports for a request that changed in that step."""
    request_id: str
    prompt_token_ids: List[int]
    finished: bool
    outputs: List[CompletionOutput] = field(default_factory=list)
    metrics: Dict[str, Any] = field(default_factory=dict)
