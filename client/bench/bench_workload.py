"""The serving benchmark's workload: seeded prose prompts, output lengths and arrival times.

Prompts are windows of `bench_prose.txt` (original prose written for this project, shipped with
the code, so no download and the same text on every machine). Each request draws a word count and
an output length from `seed` alone, so every system and every run of a sweep gets requests of
identical shape; the window positions also depend on a run `tag`, so two runs on the same server
never share prompt text and no prefix cache carries over from one run into the next. Each prompt
starts with "Passage TAG.I:" for the same reason: no two requests share a first KV block.
"""
from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

PROSE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_prose.txt")


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload."""
    index: int          # position in the run (also the request id suffix)
    prompt: str         # prose text, `num_words` whitespace-separated words
    num_words: int      # prompt length in words (tokens depend on the tokenizer)
    max_tokens: int     # tokens to generate; EOS is ignored, so exactly this many are expected


@dataclass(frozen=True)
class WorkloadSpec:
    """Shape of one benchmark run's requests (see make_requests)."""
    num_requests: int = 32
    prompt_words: Tuple[int, int] = (12, 384)
    output_tokens: Tuple[int, int] = (16, 256)
    seed: int = 0

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        for flag, (lo, hi), least in (("--prompt-words", self.prompt_words, 2),
                                      ("--output-len", self.output_tokens, 1)):
            if not least <= lo <= hi:
                raise ValueError(f"{flag} needs {least} <= MIN <= MAX, got {lo} {hi}")


@functools.lru_cache(maxsize=1)
def prose_words() -> Tuple[str, ...]:
    """The words of the shipped prose text, in order."""
    with open(PROSE_FILE, encoding="utf-8") as f:
        words = tuple(f.read().split())
    assert len(words) > 1000, f"{PROSE_FILE} is too short ({len(words)} words)"
    return words


def prose_prompt(num_words: int, rng: random.Random, label: str) -> str:
    """"Passage LABEL:" then prose from a random word on (wrapping around), num_words words in all."""
    words = prose_words()
    start = rng.randrange(len(words))
    body = [words[(start + k) % len(words)] for k in range(max(num_words - 2, 0))]
    return " ".join(["Passage", f"{label}:"] + body)


def make_requests(spec: WorkloadSpec, tag: str = "0") -> List[BenchRequest]:
    """The run's requests. Lengths depend only on spec.seed; prompt text also on `tag`."""
    spec.validate()
    shape_rng = random.Random(f"tritium-bench-shape:{spec.seed}")
    text_rng = random.Random(f"tritium-bench-text:{spec.seed}:{tag}")
    out = []
    for i in range(spec.num_requests):
        n_words = shape_rng.randint(*spec.prompt_words)
        n_out = shape_rng.randint(*spec.output_tokens)
        out.append(BenchRequest(i, prose_prompt(n_words, text_rng, f"{tag}.{i}"), n_words, n_out))
    return out


def single_stream_requests(num_requests: int, num_words: int = 12, max_tokens: int = 128, seed: int = 0,
                           tag: str = "single") -> List[BenchRequest]:
    """`num_requests` equal requests (a short prompt, max_tokens out) to send one at a time."""
    spec = WorkloadSpec(num_requests, (num_words, num_words), (max_tokens, max_tokens), seed)
    return make_requests(spec, tag)


def poisson_arrivals(num_requests: int, rate: Optional[float], seed: int = 0) -> List[float]:
    """Send times in seconds from the start: a Poisson process at `rate` requests/s (seeded);
    all zeros when rate is None (every request is ready at once)."""
    if rate is None:
        return [0.0] * num_requests
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 requests/s, got {rate}")
    rng = random.Random(f"tritium-bench-arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def parse_concurrency(text: str) -> List[int]:
    """"1,4,16" -> [1, 4, 16]; ValueError naming --concurrency otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--concurrency must be a comma-separated list of integers >= 1 (e.g. 1,4,16,64), "
                         f"got {text!r}")
    return values
