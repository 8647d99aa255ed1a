"""SamplingParams: how one request is decoded, and the one declaration of every request field.

Each attribute is declared once with request_field() (backend/request_fields.py): kind, default,
range, and its name on every surface (Triton tensor, vllm_backend `sampling_parameters` key,
OpenAI body name, `tritium generate` flag). Building a SamplingParams checks every field, so a
built one is valid; the limits that depend on the engine (context length, vocabulary) are
checked once more at admission by check_context(). To add a field, add one attribute here.

Order in which the sampler applies them (see backend/sampler.py):
    bad words / min_tokens bans -> repetition penalty -> presence & frequency penalties
    -> temperature -> top-k -> top-p -> min-p -> sample (greedy when is_greedy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from .errors import RequestError
from .guided.params import GuidedDecodingParams
from .request_fields import MAX_INT32, fields_of, request_field

DEFAULT_MAX_TOKENS = 16       # the completions APIs' default (OpenAI, vLLM, tensorrtllm_backend)
MAX_LOGPROBS = 20             # top logprobs per token
MAX_N = 64
# Stop strings and bad words: a request may not make every step of the batch slower, nor pin
# much memory (each stop string keeps a set of its prefixes, each bad word an index entry).
MAX_NUM_STOP = 32
MAX_NUM_BAD_WORDS = 256
MAX_WORD_CHARS = 128          # per stop string / bad word
MAX_NUM_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300          # entries of logit_bias (OpenAI's own limit)


@dataclass
class SamplingParams:
    """Per-request decoding parameters (the engine API's contract); see each field's doc."""
    max_tokens: Optional[int] = request_field(
        DEFAULT_MAX_TOKENS, "int", lo=1, hi=MAX_INT32, nullable=True, tensor="max_tokens", json_key="max_tokens",
        openai="max_tokens", cli="--max-tokens",
        doc="tokens to generate; null: up to the end of the context (the chat API's default)")
    temperature: float = request_field(
        1.0, "float", lo=0.0, hi=2.0, tensor="temperature", json_key="temperature", openai="temperature",
        cli="--temperature", cli_default=0.0,
        doc="0 = greedy; 2 is the OpenAI API's top; `tritium generate` defaults to greedy (reproducible)")
    top_k: Optional[int] = request_field(
        None, "int", lo=1, hi=MAX_INT32, off=(0, -1), tensor="top_k", json_key="top_k", openai="top_k", cli="--top-k",
        doc="keep the k most likely tokens; 0, -1 (the wire formats' off values) or null: off")
    top_p: float = request_field(
        1.0, "float", lo=0.0, lo_open=True, hi=1.0, tensor="top_p", json_key="top_p", openai="top_p",
        cli="--top-p", doc="nucleus sampling: the smallest set of tokens with this much probability")
    min_p: float = request_field(
        0.0, "float", lo=0.0, hi=1.0, tensor="min_p", json_key="min_p", openai="min_p", cli="--min-p",
        doc="drop tokens less likely than min_p x the most likely one")
    repetition_penalty: float = request_field(
        1.0, "float", lo=0.0, lo_open=True, tensor="repetition_penalty", json_key="repetition_penalty",
        openai="repetition_penalty", cli="--repetition-penalty", doc="CTRL's repetition penalty; 1 = off")
    presence_penalty: float = request_field(
        0.0, "float", lo=-2.0, hi=2.0, tensor="presence_penalty", json_key="presence_penalty",
        openai="presence_penalty", cli="--presence-penalty", doc="subtracted once from seen tokens' logits")
    frequency_penalty: float = request_field(
        0.0, "float", lo=-2.0, hi=2.0, tensor="frequency_penalty", json_key="frequency_penalty",
        openai="frequency_penalty", cli="--frequency-penalty", doc="subtracted per occurrence of a token")
    seed: Optional[int] = request_field(
        None, "int", lo=0, hi=2 ** 63 - 1, tensor="seed", tensor_type="TYPE_UINT64", json_key="seed",
        openai="seed", cli="--seed", doc="per-request sampling seed (the same tokens whatever shares the batch)")
    min_tokens: int = request_field(
        0, "int", lo=0, hi=MAX_INT32, tensor="min_tokens", json_key="min_tokens", openai="min_tokens",
        cli="--min-tokens",
        doc="EOS and stops are banned before this many tokens (at most max_tokens)")
    ignore_eos: bool = request_field(
        False, "bool", json_key="ignore_eos", openai="ignore_eos", cli="--ignore-eos",
        doc="keep generating past the model's EOS")
    stop: List[str] = request_field(
        [], "words", max_items=MAX_NUM_STOP, max_chars=MAX_WORD_CHARS, tensor="stop_words", json_key="stop",
        openai="stop", cli="--stop", doc="stop strings (not emitted); a single string is a list of one")
    stop_token_ids: List[int] = request_field(
        [], "ids", max_items=MAX_NUM_STOP_TOKEN_IDS, json_key="stop_token_ids", openai="stop_token_ids",
        cli="--stop-token-id", doc="token ids that end the output (the Triton input end_id adds one)")
    bad_words: List[str] = request_field(
        [], "words", max_items=MAX_NUM_BAD_WORDS, max_chars=MAX_WORD_CHARS, tensor="bad_words",
        json_key="bad_words", openai="bad_words", cli="--bad-word", doc="strings never generated")
    logprobs: Optional[int] = request_field(
        None, "int", lo=0, hi=MAX_LOGPROBS, json_key="logprobs", cli="--logprobs",
        doc="the sampled token's logprob plus the top N per token (0: sampled only); the OpenAI "
            "endpoints spell it their own way (completions logprobs, chat logprobs + top_logprobs)")
    n: int = request_field(
        1, "int", lo=1, hi=MAX_N, tensor="num_return_sequences", json_key="n", openai="n", cli="--n",
        doc="independent samples; they share the prompt's KV blocks")
    logit_bias: Optional[Dict[int, float]] = request_field(
        None, "bias", lo=-100.0, hi=100.0, max_items=MAX_LOGIT_BIAS, json_key="logit_bias",
        openai="logit_bias", cli="--logit-bias", doc="{token id: bias} added to those logits before sampling")
    # LoRA (backend/lora/, docs/lora.md): which adapter the request runs with. The engine resolves
    # the name / id against its adapters at admission (an unknown one is a bad_parameter naming it).
    lora_name: Optional[str] = request_field(
        None, "str", max_chars=256, json_key="lora_name", cli="--lora-name",
        doc="the LoRA adapter to generate with (vllm_backend's key): one the model serves; null: the base model")
    lora_task_id: Optional[int] = request_field(
        None, "int", lo=0, hi=2 ** 63 - 1, tensor="lora_task_id", tensor_type="TYPE_UINT64",
        doc="tensorrtllm_backend's LoRA adapter id: cached with lora_weights + lora_config on first use, then alone")
    # Structured outputs (backend/guided/): a JSON schema / regex / grammar / choice guide, built by
    # guided/surfaces.py from each surface's spellings (guided_decoding_* tensors, structured_outputs /
    # guided_* JSON keys, OpenAI response_format); its mask comes first, so logprobs report the
    # constrained distribution. Not a plain request field: one field, several wire forms.
    guided: Optional[GuidedDecodingParams] = None

    def __post_init__(self):
        for f in FIELDS:
            setattr(self, f.name, f.check(getattr(self, f.name)))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be in [0, max_tokens {self.max_tokens}], got {self.min_tokens}",
                               field="min_tokens")
        if self.guided is not None:
            if not isinstance(self.guided, GuidedDecodingParams):
                raise RequestError(f"guided must be a GuidedDecodingParams, got {type(self.guided).__name__}",
                                   field="guided")
            try:
                self.guided.validate()
            except ValueError as e:
                raise RequestError(str(e), field="guided") from None
            if self.ignore_eos:
                raise RequestError(f"ignore_eos cannot be combined with {self.guided.source}: the grammar "
                                   "decides where the output ends (EOS only where it may end)", field="ignore_eos")

    @property
    def is_greedy(self) -> bool:
        """The one definition of greedy decoding: temperature 0 (the argmax, no randomness)."""
        return self.temperature == 0.0

    def check_context(self, max_seq_len: int, vocab_size: int, prompt_len: int) -> None:
        """The limits that depend on the engine: the prompt and max_tokens fit max_seq_len, token
        ids are in the vocabulary. Raises RequestError (too_long or bad_parameter) naming the field."""
        if prompt_len <= 0:
            raise RequestError("prompt must not be empty (got 0 tokens)", field="prompt")
        if prompt_len >= max_seq_len:
            raise RequestError(f"prompt has {prompt_len} tokens; the engine's max_seq_len is {max_seq_len}, "
                               f"so prompts must have at most {max_seq_len - 1} tokens",
                               field="prompt", code="too_long")
        if self.max_tokens is not None and prompt_len + self.max_tokens > max_seq_len:
            raise RequestError(f"max_tokens must be in [1, {max_seq_len - prompt_len}] for this {prompt_len}-token "
                               f"prompt (max_seq_len {max_seq_len}), got {self.max_tokens}",
                               field="max_tokens", code="too_long")
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise RequestError(f"stop_token_ids entries must be token ids in [0, {vocab_size}), got {t}",
                                   field="stop_token_ids")
        for t in self.logit_bias or {}:
            if t >= vocab_size:
                raise RequestError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {t}",
                                   field="logit_bias")


FIELDS = fields_of(SamplingParams)
FIELD = {f.name: f for f in FIELDS}
