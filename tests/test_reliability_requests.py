"""Single hostile requests, in process: tiny temperatures, huge stop / bad-word lists, deeply
nested sampling_parameters. Each gets a clear error or a correct answer, never NaN tokens."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from tritium.backend.bad_words import BadWordsIndex
from tritium.backend.detokenizer import stop_prefix_overlap
from tritium.backend.sampler import Sampler
from tritium.backend.sampling_params import (MAX_NUM_BAD_WORDS, MAX_NUM_STOP, MAX_NUM_STOP_TOKEN_IDS, MAX_WORD_CHARS,
                                             SamplingParams)
from tritium.backend.sequence import Request
from tritium.backend.triton_backend.request import parse_row, parse_sampling_parameters

TINY_TEMPERATURES = [1e-38, 1.4e-45, 1e-300, 1e-7]


def _seq(params, prompt=(1, 2, 3), **kw):
    return Request("r", list(prompt), params, **kw).seqs[0]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_samples_the_argmax(temperature):
    torch.manual_seed(0)
    logits = torch.randn(8, 1000) * 10
    seqs = [_seq(SamplingParams(temperature=temperature, top_p=0.9 if i % 2 else 1.0, top_k=i % 3))
            for i in range(8)]
    toks, _ = Sampler()(logits, seqs)
    assert toks == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES[:3])
def test_tiny_temperature_in_the_engine_equals_greedy(tiny_engine, temperature):
    from tritium.backend.engine import LLMEngine
    eng = LLMEngine(tiny_engine("llama"))
    greedy = eng.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    tiny = eng.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=temperature))[0].outputs[0]
    assert tiny.token_ids == greedy.token_ids and tiny.text == greedy.text


@pytest.mark.parametrize("field,kw,limit", [
    ("bad_words", dict(bad_words=["w"] * (MAX_NUM_BAD_WORDS + 1)), MAX_NUM_BAD_WORDS),
    ("bad_words", dict(bad_words=["w" * (MAX_WORD_CHARS + 1)]), MAX_WORD_CHARS),
    ("stop", dict(stop=["s"] * (MAX_NUM_STOP + 1)), MAX_NUM_STOP),
    ("stop", dict(stop="s" * (MAX_WORD_CHARS + 1)), MAX_WORD_CHARS),
    ("stop_token_ids", dict(stop_token_ids=[1] * (MAX_NUM_STOP_TOKEN_IDS + 1)), MAX_NUM_STOP_TOKEN_IDS),
])
def test_word_lists_are_capped_with_the_limit_named(field, kw, limit):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw).check_context(2048, 100, 3)
    assert field in str(e.value) and str(limit) in str(e.value)


def test_word_lists_at_the_limit_pass():
    SamplingParams(bad_words=["w" * MAX_WORD_CHARS] * MAX_NUM_BAD_WORDS,
                   stop=["s" * MAX_WORD_CHARS] * MAX_NUM_STOP).check_context(2048, 100, 3)


def _naive_bans(words, token_ids):
    """The definition: a word's last token is banned when the tokens before it end the sequence."""
    out = set()
    for w in words:
        k = len(w) - 1
        if k == 0 or (len(token_ids) >= k and list(token_ids[len(token_ids) - k:]) == list(w[:-1])):
            out.add(w[-1])
    return out


def test_bad_words_index_matches_the_definition():
    rng = random.Random(3)
    for _ in range(200):
        words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(0, 12))]
        index = BadWordsIndex(words)
        ids = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        always = set(index.always.tolist()) if index.always is not None else set()
        assert always | set(index.context_bans(ids)) == _naive_bans(words, ids), (words, ids)


def test_bad_words_in_the_sampler_use_the_index():
    logits = torch.zeros(1, 10)
    logits[0, 7] = 5.0
    logits[0, 8] = 4.0
    words = [[7], [1, 2, 8]] + [[3, 3, 3, 9]] * 100
    seq = _seq(SamplingParams(temperature=0.0), prompt=(1, 2), bad_words_ids=words)
    assert Sampler()(logits, [seq])[0] == [0]  # 7 always banned, 8 right after (1, 2)
    seq.token_ids.append(4)  # (1, 2) no longer ends the sequence: 8 is allowed again, 7 is not
    assert Sampler()(logits, [seq])[0] == [8]


def _naive_overlap(text, stops):
    best = 0
    for s in stops:
        for k in range(1, min(len(s) - 1, len(text)) + 1):
            if text.endswith(s[:k]):
                best = max(best, k)
    return best


def test_stop_prefix_overlap_matches_the_definition():
    rng = random.Random(5)
    for _ in range(500):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 10)))
        assert stop_prefix_overlap(text, stops) == _naive_overlap(text, stops), (text, stops)


@pytest.mark.parametrize("text", ["[" * 5000, "{\"stop\": " + "[" * 100_000 + "]" * 100_000 + "}",
                                  '{"seed": ' + "9" * 5000 + "}"])
def test_hostile_sampling_parameters_are_clean_value_errors(text):
    with pytest.raises(ValueError, match="sampling_parameters"):
        parse_sampling_parameters(text)
    arrays = {"text_input": np.array([[b"hi"]], dtype=np.object_),
              "sampling_parameters": np.array([[text.encode()]], dtype=np.object_)}
    with pytest.raises(ValueError, match="sampling_parameters"):
        parse_row(arrays, 0, 1, 100)


def test_oversized_sampling_parameters_name_the_limit():
    with pytest.raises(ValueError, match="sampling_parameters has .* characters; at most"):
        parse_sampling_parameters(json.dumps({"stop": ["x" * 100] * 20_000}))


class _SpyTokenizer:
    """Records how many characters each encode() call was given."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def encode(self, text, *a, **kw):
        self.calls.append(len(text))
        return self.tok.encode(text, *a, **kw)


def test_overlong_prompt_is_rejected_after_tokenizing_a_bounded_head(tiny_engine):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.prompt_limits import encode_prompt, max_token_chars
    eng = LLMEngine(tiny_engine("llama"))
    chars = max_token_chars(eng.tokenizer)
    assert all(len(eng.tokenizer.decode([i])) <= chars for i in range(eng.config.model.vocab_size))
    spy = _SpyTokenizer(eng.tokenizer)
    with pytest.raises(ValueError, match=f"max_seq_len is {eng.max_seq_len}"):
        encode_prompt(spy, "hello world " * 200_000, eng.max_seq_len, chars)
    assert max(spy.calls) <= (eng.max_seq_len + 2) * chars < 2_400_000
    ok = "hello world " * 3
    assert encode_prompt(spy, ok, eng.max_seq_len, chars) == eng.tokenizer.encode(ok).ids
    # a long prompt that is only whitespace-light text of few tokens is not refused by the head rule
    assert len(eng.tokenizer.encode("x" * 50).ids) < eng.max_seq_len


def test_n_samples_that_do_not_fit_together_run_one_at_a_time(tiny_engine):
    """The "can never fit" check counts one sample, on purpose: samples that do not fit together
    are preempted and recomputed in turn, so n does not make a request impossible."""
    from tritium.backend.engine import LLMEngine
    eng = LLMEngine(tiny_engine("llama"), num_kv_blocks=3)
    bs = eng.block_size
    prompt = list(range(1, bs + 1))  # one full block; each sample needs one more of its own
    params = dict(max_tokens=bs, temperature=1.0, seed=0, ignore_eos=True)
    out = eng.generate(prompt_token_ids=[prompt], params=SamplingParams(n=4, **params))[0]
    assert [len(o.token_ids) for o in out.outputs] == [bs] * 4  # 1 + 4 blocks wanted, 3 in the pool
    assert eng.stats()["preemptions"] > 0 and eng.stats()["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="can never fit"):  # one sample alone needs 4 blocks
        eng.add_request("big", prompt_token_ids=prompt, params=SamplingParams(**{**params, "max_tokens": 3 * bs}))
