"""Random structured-output cases for the tests, and the oracles that judge the outputs.

Schemas are drawn from the JSON Schema keywords xgrammar converts (object / properties /
required / additionalProperties false, string with maxLength / enum / const / pattern, integer
with minimum / maximum, boolean, null, array with items / minItems / maxItems, anyOf), bounded
so a random model can finish them. Oracles: `jsonschema` validates a finished JSON output,
`re.fullmatch` a regex output; xgrammar's own matcher (a compiler the engine does not share)
replays every output token by token, so an output cut by max_tokens is still checked as a
prefix of the language.
"""
from __future__ import annotations

import json
import random
import re

import jsonschema

from tritium.backend.guided.params import GuidedDecodingParams, json_schema

WORDS = ["id", "name", "ok", "tags", "score", "kind", "city", "note", "x", "é", "東京", "a b"]
REGEXES = [r"[a-z]{2,6}", r"\d{3}-\d{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,5} [0-9]{1,3}", r"0x[0-9a-f]{1,8}",
           r"(ab|cd)+e?", r"[a-c]{1,3}(\.[a-c]{1,3}){0,2}", r"-?[1-9][0-9]{0,3}", r"(true|false)", r"\w{1,4}@\w{1,4}\.com"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "array", "object", "null", "anyOf", "const", "pattern"]
    if depth >= 2:
        kinds = ["string", "integer", "boolean", "enum", "const"]
    k = rng.choice(kinds)
    if k == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if k == "pattern":
        return {"type": "string", "pattern": "^" + rng.choice(REGEXES[:6]) + "$"}
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True, "a\"q"], rng.randint(1, 4))}
    if k == "const":
        return {"const": rng.choice(["fixed", 7, False])}
    if k == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if k == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(0, len(names))),
            "additionalProperties": False}


def random_case(rng: random.Random):
    """(GuidedDecodingParams, description) for one constrained request: mostly JSON schemas."""
    r = rng.random()
    if r < 0.7:
        schema = random_schema(rng)
        if rng.random() < 0.7:  # top-level objects are what users ask for most
            schema = {"type": "object", "properties": {"v": schema, "w": random_schema(rng, 1)},
                      "required": ["v"], "additionalProperties": False}
        return json_schema(schema, "test"), schema
    if r < 0.85:
        rx = rng.choice(REGEXES)
        return GuidedDecodingParams("regex", rx), rx
    if r < 0.95:
        choices = tuple(rng.sample(["yes", "no", "maybe", "東京", "a\"b", "line\nbreak", "{}", "x" * 12], rng.randint(1, 5)))
        return GuidedDecodingParams("choice", choices), choices
    return GuidedDecodingParams("json"), None


class Oracle:
    """xgrammar's matcher on its own compiler (same tokenizer), plus jsonschema / re.fullmatch."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        import xgrammar as xgr

        from tritium.backend.guided.compiler import tokenizer_info
        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, eos_ids))
        self.eos = set(eos_ids)

    def check(self, guided: GuidedDecodingParams, spec, completion) -> bool:
        """Assert the completion obeys its guide; returns True when it is complete (finished by
        the grammar), False when cut by max_tokens (then it must be a valid prefix)."""
        ids, text, reason = completion.token_ids, completion.text, completion.finish_reason
        m = self.xgr.GrammarMatcher(self.compiler.compile_grammar(guided.grammar()))
        for j, t in enumerate(ids):
            assert m.accept_token(t), f"token {j} ({t}) of {ids} rejected by xgrammar's matcher for {spec!r}"
        if reason == "length":
            assert not m.is_terminated()
            return False
        assert reason == "stop", (reason, text, spec)
        assert ids and ids[-1] in self.eos and m.is_terminated(), (ids, spec)
        if guided.kind in ("json_schema", "json"):
            value = json.loads(text)
            jsonschema.validate(value, spec if spec is not None else {"type": "object"})
        elif guided.kind == "regex":
            assert re.fullmatch(spec, text), (spec, text)
        elif guided.kind == "choice":
            assert text in spec, (spec, text)
        return True
