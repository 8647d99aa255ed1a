"""The guided-decoding request field: one typed object every surface builds (docs/structured-outputs.md).

A `GuidedDecodingParams(kind, guide)` rides on SamplingParams.guided. Surfaces map their own
spelling onto it and name their own field in errors (`source`):
  Triton tensors   guided_decoding_guide_type + guided_decoding_guide  (tensorrtllm_backend)
  vLLM JSON        sampling_parameters.structured_outputs / guided_json / guided_regex /
                   guided_choice / guided_grammar / guided_decoding
  OpenAI           response_format (json_object, json_schema), tools + tool_choice
  CLI              tritium generate --json-schema FILE / --regex / --choice
Kinds:
  json            any JSON object (OpenAI's json_object; TensorRT-LLM's JSON guide type)
  json_schema     JSON text of a JSON Schema (draft 2020-12 subset that xgrammar converts)
  regex           a regular expression the whole output matches
  ebnf_grammar    an EBNF (GBNF dialect) grammar with a `root` rule
  choice          exactly one of a list of strings
  structural_tag  xgrammar's structural tag JSON (tags that switch grammars on triggers)
JSON is generated compact (no free whitespace between tokens): free whitespace lets a weak model
loop on spaces until max_tokens.
"""
from __future__ import annotations

from .xgr import xgrammar

import json
import re
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "choice", "structural_tag")
# Aliases the wire formats use for the same kinds.
_ALIASES = {"json_object": "json", "grammar": "ebnf_grammar", "ebnf": "ebnf_grammar"}
MAX_GUIDE_CHARS = 64 * 1024     # a schema / regex / grammar / structural tag, as text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024          # per choice
# xgrammar's errors start "[hh:mm:ss] /project/cpp/file.cc:123: "; users get the message only.
_XGR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


@dataclass(frozen=True)
class GuidedDecodingParams:
    """What the output must match. `guide` is the schema / regex / grammar text, a tuple of
    strings for `choice`, None for `json`. `source` names the request field in errors."""
    kind: str
    guide: Union[str, Tuple[str, ...], None] = None
    source: str = field(default="guided_decoding_guide", compare=False)

    @property
    def type_source(self) -> str:
        return "guided_decoding_guide_type" if self.source == "guided_decoding_guide" else self.source

    def validate(self) -> "GuidedDecodingParams":
        """Check kind and size (cheap, no tokenizer); raise ValueError naming the field."""
        if self.kind not in GUIDE_TYPES:
            raise ValueError(f"{self.type_source}: unknown guide type {self.kind!r}; "
                             f"allowed: {', '.join(GUIDE_TYPES)}")
        if self.kind == "json":
            return self
        if self.kind == "choice":
            if not isinstance(self.guide, tuple) or not self.guide:
                raise ValueError(f"{self.source} must be a non-empty list of strings for choice")
            if len(self.guide) > MAX_CHOICES:
                raise ValueError(f"{self.source} has {len(self.guide)} choices; at most {MAX_CHOICES} are allowed")
            for c in self.guide:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise ValueError(f"{self.source}: each choice must be a non-empty string of at most "
                                     f"{MAX_CHOICE_CHARS} characters, got {c!r:.80}")
            return self
        if not isinstance(self.guide, str) or not self.guide.strip():
            raise ValueError(f"{self.source} must be a non-empty string for guide type {self.kind}")
        if len(self.guide) > MAX_GUIDE_CHARS:
            raise ValueError(f"{self.source} has {len(self.guide)} characters; at most {MAX_GUIDE_CHARS} "
                             f"are allowed (MAX_GUIDE_CHARS)")
        if self.kind in ("json_schema", "structural_tag"):
            try:
                v = json.loads(self.guide)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"{self.source} must be JSON text for guide type {self.kind} ({e})") from None
            if self.kind == "json_schema" and not isinstance(v, (dict, bool)):
                raise ValueError(f"{self.source} must be a JSON Schema (an object or a bool), got {type(v).__name__}")
        return self

    def grammar(self):
        """The xgrammar Grammar (fast, tokenizer-independent); ValueError naming the field if it
        does not convert (unsupported schema keyword, bad regex, undefined rule, ...)."""
        xgr = xgrammar()
        try:
            if self.kind == "json":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if self.kind == "json_schema":
                return _json_strings_fixed(xgr.Grammar.from_json_schema(self.guide, any_whitespace=False))
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.guide)
            if self.kind == "ebnf_grammar":
                return xgr.Grammar.from_ebnf(self.guide)
            if self.kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                       for c in self.guide))
            return xgr.Grammar.from_structural_tag(self.guide)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            msg = _XGR_PREFIX.sub("", str(e)).strip().splitlines()
            raise ValueError(f"{self.source}: the {self.kind} guide does not compile: "
                             f"{msg[0] if msg else type(e).__name__}") from None


# xgrammar 0.2.8 writes a string with minLength / maxLength as `"\"" chars{m, n} "\""` with
# chars ::= [^"\\\r\n]: it lets raw control characters through (invalid JSON, RFC 8259 section 7)
# and no escapes. The same rule with JSON's own character set, through xgrammar's EBNF parser:
_BOUNDED_CHARS = '(([^\\"\\\\\\r\\n]))'
_JSON_CHARS = '(([^\\0-\\x1f\\"\\\\]) | ("\\\\" ([\\"\\\\/bfnrt] | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))))'


def _json_strings_fixed(grammar):
    text = str(grammar)
    if _BOUNDED_CHARS not in text:
        return grammar
    xgr = xgrammar()
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHARS, _JSON_CHARS))


def from_guide_type(kind: str, guide: Optional[str], source: str = "guided_decoding_guide") -> GuidedDecodingParams:
    """tensorrtllm_backend's pair of inputs (guide type, guide text) -> GuidedDecodingParams.
    A `choice` guide is a JSON list of strings."""
    kind = _ALIASES.get(kind, kind)
    if kind == "json_schema" and isinstance(guide, str) and len(guide) <= MAX_GUIDE_CHARS:
        return json_schema(guide, source)  # compact text: equal schemas share one compiled grammar
    if kind == "choice":
        try:
            choices = json.loads(guide or "")
        except ValueError:
            raise ValueError(f"{source} must be a JSON list of strings for guide type choice") from None
        if not isinstance(choices, list):
            raise ValueError(f"{source} must be a JSON list of strings for guide type choice")
        return GuidedDecodingParams("choice", tuple(choices), source).validate()
    return GuidedDecodingParams(kind, guide or None, source).validate()


def json_schema(schema, source: str) -> GuidedDecodingParams:
    """A schema given as a dict / bool (or JSON text) -> compact JSON text (key order kept: it is
    the order of the generated properties)."""
    if isinstance(schema, str):
        if len(schema) > MAX_GUIDE_CHARS:
            raise ValueError(f"{source} has {len(schema)} characters; at most {MAX_GUIDE_CHARS} are allowed "
                             f"(MAX_GUIDE_CHARS)")
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{source} must be a JSON Schema ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{source} must be a JSON Schema (an object or a bool), got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"{source} must be a JSON Schema ({e})") from None
    return GuidedDecodingParams("json_schema", text, source).validate()
