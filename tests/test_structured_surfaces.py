"""Structured outputs and tools without a model: every wire spelling of the guide field, the
OpenAI tool-call formats, and the grammars themselves checked with xgrammar's matcher
(accept_string on a vocabulary of a tokenizer trained here) as the oracle."""
import json

import numpy as np
import pytest

from tiny_models import train_tokenizer
from tritium.backend.chat_template import normalize_messages
from tritium.backend.guided.params import GuidedDecodingParams, json_schema
from tritium.backend.guided.surfaces import from_response_format, from_tensors, from_vllm, to_tensors
from tritium.backend.triton_backend.request import parse_row, parse_sampling_parameters
from tritium.client.openai.openai_tools import (FORMATS, ToolError, call_deltas, call_guide, detect_format, held_from,
                                                parse_calls, parse_tools)

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "echo", "parameters": {
             "type": "object", "properties": {"text": {"type": "string", "maxLength": 5}}, "required": ["text"]}}}]


@pytest.fixture(scope="module")
def matcher():
    """matcher(guided) -> a fresh xgrammar GrammarMatcher for it (accept_string checks text)."""
    import xgrammar as xgr

    from tritium.backend.guided.compiler import tokenizer_info
    tok = train_tokenizer()
    compiler = xgr.GrammarCompiler(tokenizer_info(tok, tok.get_vocab_size(), [2]))
    return lambda g: xgr.GrammarMatcher(compiler.compile_grammar(g.grammar()))


def accepts(m, text: str) -> bool:
    return m.accept_string(text) and m.is_completed()


def test_tensor_and_vllm_spellings_build_the_same_guides():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    g = from_tensors("json_schema", json.dumps(schema))
    assert g == json_schema(schema, "x") and g.source == "guided_decoding_guide"
    assert from_tensors(None, None) is None and from_tensors("", "") is None
    assert from_tensors("choice", '["a", "b"]') == GuidedDecodingParams("choice", ("a", "b"))
    assert from_tensors("json", None) == GuidedDecodingParams("json")
    for d in ({"structured_outputs": {"json": schema}}, {"structured_outputs": json.dumps({"json": schema})},
              {"guided_decoding": json.dumps({"json": schema, "regex": None, "backend": "xgrammar",
                                              "some_new_field": None})},
              {"guided_json": schema}, {"guided_json": json.dumps(schema)}):
        assert from_vllm(dict(d)) == g, d
    assert from_vllm({"guided_regex": "[a-z]+"}) == GuidedDecodingParams("regex", "[a-z]+")
    assert from_vllm({"guided_choice": ["x", "y"]}) == GuidedDecodingParams("choice", ("x", "y"))
    assert from_vllm({"guided_grammar": 'root ::= "a"'}).kind == "ebnf_grammar"
    assert from_vllm({"structured_outputs": {"json_object": True}}).kind == "json"
    assert to_tensors(GuidedDecodingParams("choice", ("a", "b"))) == {
        "guided_decoding_guide_type": "choice", "guided_decoding_guide": '["a", "b"]'}
    sp = parse_sampling_parameters(json.dumps({"max_tokens": 5, "guided_regex": "[0-9]+"}))
    assert sp["guided"] == GuidedDecodingParams("regex", "[0-9]+") and sp["max_tokens"] == 5


@pytest.mark.parametrize("call,words", [
    (lambda: from_tensors("yaml", "x"), "guided_decoding_guide_type: unknown guide type 'yaml'"),
    (lambda: from_tensors(None, "x"), "needs guided_decoding_guide_type"),
    (lambda: from_tensors("choice", "nope"), "JSON list"),
    (lambda: from_vllm({"guided_json": {"type": "object"}, "guided_regex": "a"}), "give one guide"),
    (lambda: from_vllm({"structured_outputs": {"json": {}, "regex": "a"}}), "give one of"),
    (lambda: from_vllm({"structured_outputs": {"jsn": {}}}), "unknown key 'jsn'"),
    (lambda: from_vllm({"guided_choice": "a"}), "sampling_parameters.guided_choice must be a list"),
    (lambda: from_response_format({"type": "json_schema", "json_schema": {"name": "x"}}), "schema is required"),
    (lambda: from_response_format({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
     "strict"),
    (lambda: parse_sampling_parameters('{"guided_jsn": {}}'), "unknown key 'guided_jsn'"),
])
def test_bad_spellings_name_the_field(call, words):
    with pytest.raises(ValueError, match=words):
        call()


def test_triton_rows_take_the_guide_and_the_frontends_flags():
    row = parse_row({"text_input": np.array([[b"hi"]], dtype=np.object_),
                     "guided_decoding_guide_type": np.array([[b"regex"]], dtype=np.object_),
                     "guided_decoding_guide": np.array([[b"[ab]+"]], dtype=np.object_),
                     "return_num_input_tokens": np.array([[True]]), "return_num_output_tokens": np.array([[True]])},
                    0, 1)
    assert row.params["guided"] == GuidedDecodingParams("regex", "[ab]+")


def test_grammars_hold_their_language(matcher):
    assert accepts(matcher(json_schema(ADD, "x")), '{"a": 1, "b": -2}')
    assert not accepts(matcher(json_schema(ADD, "x")), '{"a": 1}')
    g = GuidedDecodingParams("choice", ("yes", "a\"b", "line\nbreak"))
    assert all(accepts(matcher(g), c) for c in g.guide) and not accepts(matcher(g), "ye")
    assert accepts(matcher(GuidedDecodingParams("regex", r"\d{3}-\d{2}")), "123-45")
    assert accepts(matcher(GuidedDecodingParams("ebnf_grammar", 'root ::= "x" [0-9]+')), "x42")
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}
    assert accepts(matcher(GuidedDecodingParams("structural_tag", json.dumps(tag)).validate()), "hello")


def test_length_bounded_strings_are_valid_json_strings(matcher):
    """xgrammar 0.2.8 lets raw control characters into a maxLength string; our rewrite does not."""
    g = json_schema({"type": "string", "maxLength": 3}, "x")
    assert not accepts(matcher(g), '"a\x19"')
    assert accepts(matcher(g), '"a\\nb"') and accepts(matcher(g), '"\\u00e9"')
    assert not accepts(matcher(g), '"abcd"')


@pytest.mark.parametrize("fmt", FORMATS)
def test_forced_call_grammar_accepts_only_calls_that_parse(matcher, fmt):
    key = "parameters" if fmt == "llama3" else "arguments"
    body = json.dumps({"name": "add", key: {"a": 1, "b": 2}})
    text = {"hermes": f"<tool_call>\n{body}\n</tool_call>", "llama3": body, "mistral": f"[TOOL_CALLS][{body}]"}[fmt]
    tr = parse_tools({"tools": TOOLS, "tool_choice": "required"}, fmt)
    assert accepts(matcher(call_guide(tr)), text)
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "echo"}}}, fmt)
    assert not accepts(matcher(call_guide(named)), text)  # a call to another function
    content, calls = parse_calls(text, tr)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("add", {"a": 1, "b": 2})]
    assert parse_calls("no call here", tr) == ("no call here", [])


def test_tool_checks_streaming_and_format_detection():
    with pytest.raises(ToolError) as e:
        parse_tools({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]})
    assert e.value.param == "tools[0].function.parameters"
    with pytest.raises(ToolError) as e:
        parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zzz"}}})
    assert e.value.param == "tool_choice"
    with pytest.raises(ToolError):
        parse_tools({"tools": TOOLS + TOOLS[:1]})  # a name twice
    assert parse_tools({"tools": TOOLS, "tool_choice": "none"}) is None
    tr = parse_tools({"tools": TOOLS}, "hermes")
    assert (held_from("Sure. <tool", tr), held_from("Sure. <tool_call>{", tr), held_from("Sure.", tr)) == (6, 6, 5)
    calls = parse_calls('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', tr)[1]
    deltas = call_deltas(calls)
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "add"
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == calls[0]["function"]["arguments"]
    assert detect_format("{{ '<tool_call>' }}") == "hermes" and detect_format("[TOOL_CALLS]") == "mistral"
    assert detect_format("<|python_tag|>") == "llama3" and detect_format(None) == "hermes"
    msgs = normalize_messages([{"role": "assistant", "content": None, "tool_calls": calls},
                               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "3"}])
    assert msgs[0]["tool_calls"] == calls and msgs[1]["tool_call_id"] == calls[0]["id"]
