"""SamplingParams: how one request is decoded. Validated once, at admission, with clear errors.

Order in which the sampler applies them (see backend/sampler.py):
    bad words / min_tokens bans -> repetition penalty -> presence & frequency penalties
    -> temperature -> top-k -> top-p -> min-p -> sample (greedy when temperature == 0).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from .guided.params import GuidedDecodingParams

# Largest number of top logprobs a request may ask for per token.
MAX_LOGPROBS = 20
MAX_N = 64
# Stop strings and bad words: a request may not make every step of the batch slower, nor pin
# much memory (each stop string keeps a set of its prefixes, each bad word an index entry).
MAX_NUM_STOP = 32
MAX_NUM_BAD_WORDS = 256
MAX_WORD_CHARS = 128          # per stop string / bad word
MAX_NUM_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300          # entries of logit_bias (OpenAI's own limit)


def _check_number(name: str, value, lo=None, hi=None, lo_open=False, hi_open=False, integer=False):
    """Raise ValueError naming `name` unless lo (<|<=) value (<|<=) hi; NaN is always rejected."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{name} must be {kind}, got NaN")
    lo_s = "(" if lo_open else "["
    hi_s = ")" if hi_open else "]"
    rng = f"{lo_s}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}{hi_s}"
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be in {rng}, got {value!r}")
    if hi is not None and (value >= hi if hi_open else value > hi):
        raise ValueError(f"{name} must be in {rng}, got {value!r}")


def _check_words(name: str, words, max_num: int) -> None:
    """A list of at most max_num non-empty strings of at most MAX_WORD_CHARS characters each."""
    if len(words) > max_num:
        raise ValueError(f"{name} has {len(words)} entries; at most {max_num} are allowed")
    for w in words:
        if not isinstance(w, str) or not w:
            raise ValueError(f"{name} must be a list of non-empty strings, got {w!r}")
        if len(w) > MAX_WORD_CHARS:
            raise ValueError(f"{name} entries must have at most {MAX_WORD_CHARS} characters, got one of {len(w)}")


@dataclass
class SamplingParams:
    """Per-request decoding parameters (the engine API's contract).

    temperature 0 means greedy. top_k None disables top-k; the wire formats' "off" values, 0
    (TensorRT-LLM) and -1 (vLLM), are read as None. `stop` strings end the output
    and are not emitted; `stop_token_ids` (and the model's EOS unless ignore_eos) end it too.
    `bad_words` are strings never generated. `logprobs` N returns the sampled token's logprob
    plus the top N (N = 0: sampled only). `n` independent samples share the prompt's KV blocks.
    `logit_bias` {token id: bias in [-100, 100]} is added to those logits before sampling.
    `guided` constrains the output to a JSON schema / regex / grammar / choice (backend/guided/);
    its mask comes first, so logprobs report the constrained distribution.
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: Union[List[str], str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    bad_words: List[str] = field(default_factory=list)
    logprobs: Optional[int] = None
    n: int = 1
    logit_bias: Optional[Dict[int, float]] = None
    guided: Optional[GuidedDecodingParams] = None

    def __post_init__(self):
        if type(self.top_k) is int and self.top_k in (0, -1):
            self.top_k = None

    def validate(self, max_seq_len: int, vocab_size: int, prompt_len: int) -> None:
        """Check every field; raise ValueError naming the first bad one and its allowed range."""
        if prompt_len <= 0:
            raise ValueError("prompt must not be empty (got 0 tokens)")
        if prompt_len >= max_seq_len:
            raise ValueError(f"prompt has {prompt_len} tokens; the engine's max_seq_len is {max_seq_len}, "
                             f"so prompts must have at most {max_seq_len - 1} tokens")
        _check_number("max_tokens", self.max_tokens, lo=1, integer=True)
        if prompt_len + self.max_tokens > max_seq_len:
            raise ValueError(f"max_tokens must be in [1, {max_seq_len - prompt_len}] for this "
                             f"{prompt_len}-token prompt (max_seq_len {max_seq_len}), got {self.max_tokens}")
        _check_number("temperature", self.temperature, lo=0.0)
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite and >= 0, got inf")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1, or 0, -1 or null for off, got {self.top_k!r}")
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        if math.isinf(self.repetition_penalty):
            raise ValueError("repetition_penalty must be finite and > 0")
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_number("seed", self.seed, lo=0, hi=2 ** 63 - 1, integer=True)
        _check_number("min_tokens", self.min_tokens, lo=0, hi=self.max_tokens, integer=True)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        _check_words("stop (stop_words)", self.stop_list, MAX_NUM_STOP)
        if isinstance(self.bad_words, str):
            raise ValueError("bad_words must be a list of strings, not a single string")
        _check_words("bad_words", self.bad_words, MAX_NUM_BAD_WORDS)
        if len(self.stop_token_ids) > MAX_NUM_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} entries; at most "
                             f"{MAX_NUM_STOP_TOKEN_IDS} are allowed")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entries must be token ids in [0, {vocab_size}), got {t!r}")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, integer=True)
        _check_number("n", self.n, lo=1, hi=MAX_N, integer=True)
        if self.logit_bias is not None:
            self._check_logit_bias(vocab_size)
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecodingParams):
                raise ValueError(f"guided must be a GuidedDecodingParams, got {type(self.guided).__name__}")
            self.guided.validate()
            if self.ignore_eos:
                raise ValueError(f"ignore_eos cannot be combined with {self.guided.source}: the grammar "
                                 "decides where the output ends (EOS only where it may end)")

    def _check_logit_bias(self, vocab_size: int) -> None:
        """{token id: bias}; ids may arrive as strings (JSON object keys); normalized in place."""
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be an object {{token id: bias}}, got {self.logit_bias!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        clean = {}
        for k, v in self.logit_bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if isinstance(k, bool) or not 0 <= tok < vocab_size:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {k!r}")
            _check_number(f"logit_bias[{k}]", v, lo=-100.0, hi=100.0)
            clean[tok] = float(v)
        self.logit_bias = clean

    @property
    def stop_list(self) -> List[str]:
        """`stop` as a list (a single string is accepted for convenience)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
