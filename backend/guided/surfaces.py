"""Every wire spelling of the guided-decoding field, in one place (docs/structured-outputs.md).

  Triton tensors (tensorrtllm_backend): guided_decoding_guide_type (json, json_schema, regex,
      ebnf_grammar, choice, structural_tag) + guided_decoding_guide (the text; choice: a JSON list)
  vllm_backend `sampling_parameters` JSON: structured_outputs {json | regex | choice | grammar |
      json_object | structural_tag, ...options}, its older name guided_decoding (an object or its
      JSON text, as Triton's OpenAI frontend sends it), and guided_json / guided_regex /
      guided_choice / guided_grammar / guided_json_object
  OpenAI response_format: {"type": "text" | "json_object" | "json_schema", "json_schema":
      {"name", "schema", "strict"}} (client/openai/openai_tools.py adds tools and tool_choice)
A request carries at most one guide; two are an error naming both fields. Options that only tune
vLLM's own backends (backend, whitespace_pattern, disable_*) are accepted and have no effect:
output is always compact and always constrained.
"""
from __future__ import annotations

import json
from typing import Dict, Optional

from .params import GuidedDecodingParams, from_guide_type, json_schema

TYPE_TENSOR, GUIDE_TENSOR = "guided_decoding_guide_type", "guided_decoding_guide"
# Triton inputs: (name, data type, doc), added to the backend's tensor contract.
TENSOR_INPUTS = (
    (TYPE_TENSOR, "TYPE_STRING", "json, json_schema, regex, ebnf_grammar, choice or structural_tag"),
    (GUIDE_TENSOR, "TYPE_STRING", "the schema / regex / grammar text; choice: a JSON list of strings"),
)
# vllm_backend `sampling_parameters` keys that carry a guide.
VLLM_KEYS = ("structured_outputs", "guided_decoding", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "guided_json_object")
# Inside structured_outputs / guided_decoding: the guide fields, and options without effect here.
_VLLM_GUIDE_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_VLLM_OPTIONS = ("backend", "whitespace_pattern", "disable_fallback", "disable_any_whitespace",
                 "disable_additional_properties", "backend_was_auto", "_backend", "_backend_was_auto")


def from_tensors(guide_type: Optional[str], guide: Optional[str]) -> Optional[GuidedDecodingParams]:
    """The two Triton inputs -> GuidedDecodingParams (None: no guide; type "" or "none" too)."""
    if guide_type is None or guide_type.strip().lower() in ("", "none"):
        if guide:
            raise ValueError(f"{GUIDE_TENSOR} needs {TYPE_TENSOR} (json, json_schema, regex, ebnf_grammar, "
                             "choice or structural_tag)")
        return None
    return from_guide_type(guide_type.strip().lower(), guide, GUIDE_TENSOR)


def to_tensors(g: Optional[GuidedDecodingParams]) -> Dict[str, str]:
    """The inverse of from_tensors: the two Triton inputs for a guide (client side)."""
    if g is None:
        return {}
    guide = json.dumps(list(g.guide), ensure_ascii=False) if g.kind == "choice" else (g.guide or "")
    return {TYPE_TENSOR: g.kind, GUIDE_TENSOR: guide}


def _one(fields: Dict[str, object], where: str) -> Optional[GuidedDecodingParams]:
    """vLLM's guide fields (json, regex, choice, grammar, json_object, structural_tag) -> params."""
    given = {k: v for k, v in fields.items() if v not in (None, False)}
    if len(given) > 1:
        raise ValueError(f"{where}: give one of {', '.join(_VLLM_GUIDE_FIELDS)}, got {', '.join(sorted(given))}")
    if not given:
        return None
    (key, v), = given.items()
    src = f"{where}.{key}" if where != "sampling_parameters" else f"sampling_parameters.guided_{key}"
    if key == "json":
        return json_schema(v, src)
    if key == "json_object":
        if v is not True:
            raise ValueError(f"{src} must be true or false, got {v!r}")
        return GuidedDecodingParams("json", None, src)
    if key == "choice":
        if not isinstance(v, list):
            raise ValueError(f"{src} must be a list of strings, got {v!r:.80}")
        return GuidedDecodingParams("choice", tuple(v), src).validate()
    if key == "structural_tag" and not isinstance(v, str):
        v = json.dumps(v)
    if not isinstance(v, str):
        raise ValueError(f"{src} must be a string, got {type(v).__name__}")
    kind = {"regex": "regex", "grammar": "ebnf_grammar", "structural_tag": "structural_tag"}[key]
    return GuidedDecodingParams(kind, v, src).validate()


def from_vllm(d: Dict[str, object]) -> Optional[GuidedDecodingParams]:
    """Pop the guide keys (VLLM_KEYS) out of a parsed `sampling_parameters` dict -> params or None."""
    found = {k: d.pop(k) for k in VLLM_KEYS if k in d}
    found = {k: v for k, v in found.items() if v is not None}
    guides = []
    for key, v in found.items():
        where = f"sampling_parameters.{key}"
        if key in ("structured_outputs", "guided_decoding"):
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except ValueError:
                    raise ValueError(f"{where} must be an object (or its JSON text)") from None
            if not isinstance(v, dict):
                raise ValueError(f"{where} must be an object, got {type(v).__name__}")
            # asdict() of vLLM's params class sends every field; unset ones are None / false.
            unknown = {k for k in set(v) - set(_VLLM_GUIDE_FIELDS) - set(_VLLM_OPTIONS) if v[k] not in (None, False)}
            if unknown:
                raise ValueError(f"{where}: unknown key {sorted(unknown)[0]!r}; allowed: "
                                 f"{', '.join(_VLLM_GUIDE_FIELDS + _VLLM_OPTIONS)}")
            g = _one({k: v.get(k) for k in _VLLM_GUIDE_FIELDS}, where)
        else:
            g = _one({key[len("guided_"):]: v}, "sampling_parameters")
        if g is not None:
            guides.append((key, g))
    if len(guides) > 1:
        raise ValueError(f"sampling_parameters: give one guide, got {', '.join(k for k, _ in guides)}")
    return guides[0][1] if guides else None


def from_response_format(rf, where: str = "response_format") -> Optional[GuidedDecodingParams]:
    """OpenAI's response_format -> params (None for {"type": "text"}). `strict` is accepted either
    way: the output is always held to the schema."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise ValueError(f"{where} must be an object with a type, got {rf!r:.80}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams("json", None, where)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError(f"{where}.json_schema must be an object with name and schema")
        if "strict" in js and js["strict"] is not None and not isinstance(js["strict"], bool):
            raise ValueError(f"{where}.json_schema.strict must be true or false, got {js['strict']!r}")
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise ValueError(f"{where}.json_schema.schema is required")
        return json_schema(schema, f"{where}.json_schema.schema")
    raise ValueError(f"{where}.type must be one of text, json_object, json_schema; got {kind!r}")
