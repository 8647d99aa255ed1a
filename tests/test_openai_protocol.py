"""Unit tests (no server): chat templates against transformers' apply_chat_template, the sandbox,
OpenAI parameter checks, Triton error mapping, the `messages` input and logit_bias."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tritium.backend.chat_template import (ChatTemplate, ChatTemplateError, NoChatTemplateError,
                                           read_template_source)
from tritium.backend.async_engine import EngineDeadError, EngineOverloadedError
from tritium.backend.errors import RequestError, from_wire, to_wire
from tritium.client.openai.openai_protocol import (OpenAIError, error_from_code, parse_chat_request,
                                                   parse_completion_request)

SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A Llama-3-style template: bos_token, loop controls, trim_blocks / lstrip_blocks whitespace rules.
LLAMA3 = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  "},
            {"role": "assistant", "content": "Hello!"}, {"role": "tool", "content": "x"},
            {"role": "user", "content": "Paris? Café 🙂"}]


def _engine_dir(tmp_path, template, bos="<s>"):
    cfg = {"bos_token": bos, "eos_token": {"content": "</s>"}}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("template", [SMOL, LLAMA3])
@pytest.mark.parametrize("gen", [True, False])
def test_rendering_matches_transformers(tmp_path, template, gen):
    """transformers' own apply_chat_template is the oracle."""
    from transformers import PreTrainedTokenizerFast
    from tiny_models import train_tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(300), bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    want = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    got = ChatTemplate.from_engine_dir(_engine_dir(tmp_path, template)).render(MESSAGES, add_generation_prompt=gen)
    assert got == want


def test_template_sources(tmp_path):
    assert read_template_source(_engine_dir(tmp_path, None)) is None
    with pytest.raises(NoChatTemplateError, match="no chat template"):
        ChatTemplate.from_engine_dir(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert ChatTemplate.from_engine_dir(str(tmp_path)).render([{"role": "user", "content": "x"}]) == "x"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert read_template_source(_engine_dir(tmp_path, named)) == "D"


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'x'}) }}",          # immutable sandbox: no mutation of the arguments
    "{{ cycler.__init__.__globals__.os }}",
])
def test_sandbox_refuses_unsafe_templates(evil):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(evil).render([{"role": "user", "content": "hi"}])


def test_template_errors_are_one_line_value_errors():
    with pytest.raises(ChatTemplateError, match="refused these messages: only user"):
        ChatTemplate("{{ raise_exception('only user') }}").render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


@pytest.mark.parametrize("messages,needle", [
    ([], "non-empty list"), ("hi", "non-empty list"), ([{"role": "bot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
])
def test_bad_messages_name_the_field(messages, needle):
    with pytest.raises(OpenAIError) as e:
        parse_chat_request({"model": "m", "messages": messages})
    assert e.value.status == 400 and e.value.param == "messages" and needle in e.value.message


def test_text_parts_are_joined():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert json.loads(req.requests[0]["messages"]) == [{"role": "user", "content": "ab"}]


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"), ({"n": 1000}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 1.5}, "max_tokens"),
    ({"seed": "x"}, "seed"), ({"stop": [1]}, "stop"), ({"stop": ["a"] * 40}, "stop"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"), ({"logprobs": 6}, "logprobs"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"suffix": "x"}, "suffix"),
    ({"best_of": 3}, "best_of"), ({"echo": True, "logprobs": 1}, "echo"), ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"prompt": ""}, "prompt"), ({"model": 3}, "model"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"prompt": ["a"] * 5, "n": 64}, "n"),
])
def test_completion_parameters_are_checked_by_name(body, param):
    full = {"model": "m", "prompt": "hi"}
    full.update(body)
    with pytest.raises(OpenAIError) as e:
        parse_completion_request(full)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_completion_request_maps_onto_the_contract():
    req = parse_completion_request({"model": "m", "prompt": ["a", "b"], "max_tokens": 5, "temperature": 0, "n": 2,
                                    "stop": "x", "seed": 3, "logprobs": 2, "logit_bias": {"7": -100},
                                    "user": "ignored", "stream": True, "stream_options": {"include_usage": True}})
    assert len(req.requests) == 2 and req.n == 2 and req.stream and req.include_usage and req.logprobs == 2
    r = req.requests[0]
    assert r["prompt"] == "a" and r["stream"] is True and r["return_log_probs"] is True
    sp = json.loads(r["sampling_parameters"])
    assert sp == {"max_tokens": 5, "temperature": 0.0, "n": 2, "stop": ["x"], "seed": 3, "logprobs": 2,
                  "logit_bias": {"7": -100.0}}
    ids = parse_completion_request({"model": "m", "prompt": [[1, 2], [3]]})
    assert [r["input_ids"] for r in ids.requests] == [[1, 2], [3]]
    assert json.loads(ids.requests[0]["sampling_parameters"])["max_tokens"] == 16  # the API's default


def test_chat_defaults_to_the_rest_of_the_context_and_top_logprobs():
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 4, "max_completion_tokens": 9})
    sp = json.loads(req.requests[0]["sampling_parameters"])
    assert sp["max_tokens"] == 9 and sp["logprobs"] == 4 and req.logprobs == 4
    req = parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert json.loads(req.requests[0]["sampling_parameters"])["max_tokens"] is None
    assert req.logprobs is None and "return_log_probs" not in req.requests[0]


@pytest.mark.parametrize("exc,status,param,code", [
    (RequestError("max_tokens must be in [1, 10] ...", field="max_tokens", code="too_long"), 400,
     "max_completion_tokens", "context_length_exceeded"),
    (RequestError("prompt has 40 tokens ...", field="prompt", code="too_long"), 400, "messages",
     "context_length_exceeded"),
    (RequestError("logit_bias keys must be token ids in [0, 1000), got 5000", field="logit_bias"), 400,
     "logit_bias", "invalid_parameter"),
    (RequestError("stop has 40 entries; at most 32 are allowed", field="stop"), 400, "stop", "invalid_parameter"),
    (RequestError("n must be in [1, 64], got 0", field="n"), 400, "n", "invalid_parameter"),
    (EngineOverloadedError("overloaded: 1 requests are waiting (max_queue_size 1)"), 503, None, "overloaded"),
    (EngineDeadError("engine loop died"), 503, None, "engine_unavailable"),
    (NoChatTemplateError("model 'plain': engine /e has no chat template"), 400, "messages", "no_chat_template"),
    (ZeroDivisionError("x"), 500, None, "internal_error"),
])
def test_backend_errors_map_to_openai_errors_by_code(exc, status, param, code):
    """The backend's error crosses Triton as JSON (to_wire); the OpenAI layer maps its code and field."""
    wire = to_wire(exc, "batch row 0: ")
    assert json.loads(wire)["field"] == getattr(exc, "field", None)
    # tritonserver may put its own words in front; the JSON object still decodes
    e = error_from_code(from_wire("in ensemble 'x', " + wire), "chat", "max_completion_tokens")
    assert e.status == status and e.param == param and e.code == code and e.body()["error"]["message"]
    assert e.message.startswith("batch row 0: ")


def test_errors_not_from_the_backend_are_internal():
    err = from_wire("[request id: <id_unknown>] unexpected inference input 'x' for model 'm'")
    assert err.code == "internal" and err.field is None and "unexpected inference input" in err.message


def test_triton_messages_input_is_parsed_and_checked():
    from tritium.backend.triton_backend.request import parse_row
    msgs = json.dumps([{"role": "user", "content": "hi"}])
    p = parse_row({"messages": np.array([[msgs.encode()]], dtype=np.object_)}, 0, 1)
    assert p.messages == [{"role": "user", "content": "hi"}] and p.prompt is None
    with pytest.raises(ValueError, match="one of text_input, input_ids and messages"):
        parse_row({"messages": np.array([[msgs.encode()]], dtype=np.object_),
                   "text_input": np.array([[b"x"]], dtype=np.object_)}, 0, 1)
    with pytest.raises(ValueError, match="messages must be a JSON list"):
        parse_row({"messages": np.array([[b"{nope"]], dtype=np.object_)}, 0, 1)
    p = parse_row({"text_input": np.array([[b"x"]], dtype=np.object_),
                   "sampling_parameters": np.array([[b'{"max_tokens": null, "logit_bias": {"3": 1.5}}']],
                                                   dtype=np.object_)}, 0, 1)
    assert p.params["max_tokens"] is None and p.sampling.max_tokens is None and p.sampling.logit_bias == {3: 1.5}


def test_logit_bias_shifts_exactly_those_logits():
    """Sampler step 1b: logits[id] += bias before sampling (greedy sees the shifted argmax)."""
    import torch
    from tritium.backend.sampler import Sampler
    from tritium.backend.sampling_params import SamplingParams

    class Req:
        def __init__(self, params):
            self.params = params
            self.min_tokens_bans = None

            class _BW:
                always = None

                def __bool__(self):
                    return False

                def context_bans(self, ids):
                    return []
            self.bad_words = _BW()

    class Seq:
        def __init__(self, params):
            self.request = Req(params)
            self.token_ids = [1]
            self.output_token_ids = []
            self.num_output_tokens = 0
            self.generator = None

    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    sp = SamplingParams(temperature=0.0, logit_bias={"3": 0.2, "1": -1.0}, logprobs=0)
    sp.check_context(max_seq_len=64, vocab_size=4, prompt_len=1)
    assert sp.logit_bias == {3: 0.2, 1: -1.0}
    tokens, entries = Sampler()(logits.clone(), [Seq(sp)])
    assert tokens == [3]
    # logprobs stay the model's raw log-softmax (before the bias)
    assert entries[0]["logprob"] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 3]))
    with pytest.raises(ValueError, match=r"logit_bias keys must be token ids in \[0, 4\)"):
        SamplingParams(logit_bias={"9": 1.0}).check_context(max_seq_len=64, vocab_size=4, prompt_len=1)
    with pytest.raises(ValueError, match=r"logit_bias values must be numbers in \[-100, 100\], got 200"):
        SamplingParams(logit_bias={1: 200})


def test_answer_shapes_for_two_prompts_with_echo_and_usage():
    """Chunks as Triton sends them (per prompt, per sample) -> the API's choice numbering, echo and usage."""
    from tritium.client.openai.openai_responses import AnswerBuilder
    from tritium.client.triton_client import Chunk
    req = parse_completion_request({"model": "m", "prompt": ["Hi", "Yo"], "n": 2, "echo": True, "stream": True,
                                    "stream_options": {"include_usage": True}})
    b = AnswerBuilder(req)
    assert [c["choices"][0]["text"] for c in b.first_chunks()] == ["Hi", "Hi", "Yo", "Yo"]
    events = []
    for p, ch in ((0, Chunk(" a", [5], None, 3, 1, sequence_index=1)), (1, Chunk(" b", [6], "stop", 4, 1)),
                  (0, Chunk("!", [7], "length", 3, 2, sequence_index=1)), (0, Chunk(" c", [8], "stop", 3, 1)),
                  (1, Chunk(" d", [9], "length", 4, 1, sequence_index=1))):
        b.add(p, ch)
        events += b.stream_chunks(p, ch)
    assert [(e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in events] == [
        (1, " a", None), (2, " b", "stop"), (1, "!", "length"), (0, " c", "stop"), (3, " d", "length")]
    assert all(e["usage"] is None for e in events)
    assert b.usage_chunk()["choices"] == [] and b.usage() == {"prompt_tokens": 7, "completion_tokens": 5,
                                                              "total_tokens": 12}
    whole = b.answer()
    assert [c["text"] for c in whole["choices"]] == ["Hi c", "Hi a!", "Yo b", "Yo d"]
    assert whole["object"] == "text_completion" and whole["usage"]["total_tokens"] == 12


def test_chat_stream_starts_with_the_role_and_ends_with_finish_reason():
    from tritium.client.openai.openai_responses import AnswerBuilder
    from tritium.client.triton_client import Chunk
    b = AnswerBuilder(parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                          "stream": True}))
    events = []
    for ch in (Chunk("Hel", [1], None, 9, 1), Chunk("", [2], None, 9, 2), Chunk("lo", [3], "stop", 9, 3)):
        b.add(0, ch)
        events += b.stream_chunks(0, ch)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}, {}]
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and "usage" not in events[0]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert b.answer()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
