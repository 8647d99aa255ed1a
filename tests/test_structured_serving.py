"""Structured outputs and tool calling through a real `tritium serve` (tritonserver + the OpenAI
API), on a tiny random Llama with SmolLM2's tokenizer and a Hermes-style chat template that
renders `tools`.

Oracles: the official `openai` package drives the API (`tritium generate` its flags); jsonschema
validates every JSON answer and every tool call's arguments; the in-process engine (LLMEngine, greedy) gives the tokens that
tritonserver must return over gRPC, for the LLM model and for the ensemble; the request that
Triton's own OpenAI frontend builds for a non-vLLM model (its tensors, dtypes and shapes, from
triton-inference-server/server python/openai/.../utils/triton.py) is answered with
num_input_tokens / num_output_tokens.
"""
from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil

import jsonschema
import numpy as np
import pytest

from structured_cases import random_schema
from serving_utils import tritium_serve

pytestmark = pytest.mark.slow

HERMES = """{%- if tools %}<|im_start|>system
Call a tool as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>. Tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}</tool_call>
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "sum", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def built(smollm2_tokenizer_checkpoint, tmp_path_factory):
    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("structured")
    ckpt = str(root / "ckpt")
    shutil.copytree(smollm2_tokenizer_checkpoint(), ckpt)
    with open(os.path.join(ckpt, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": HERMES, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}, f)
    engine, repo = str(root / "engine"), str(root / "repo")
    assert main(["build", ckpt, "-o", engine, "--dtype", "float32", "--max-batch-size", "16", "--quiet",
                 "--repo", repo, "--name", "tiny"]) == 0
    return engine, repo, str(root)


@pytest.fixture(scope="module")
def served(built):
    engine, repo, root = built
    env = dict(os.environ, TRITIUM_CACHE=os.path.join(root, "cache"))
    with tritium_serve(repo, root, env=env) as (proc, lines):
        text = "".join(lines)
        yield {"grpc": re.search(r"gRPC (\S+)", text).group(1), "base": re.search(r"OpenAI API: (\S+)", text).group(1)}


@pytest.fixture(scope="module")
def client(served):
    import openai
    return openai.OpenAI(base_url=served["base"], api_key="unused", max_retries=0, timeout=300)


def grpc_infer(url, model, inputs):
    """One streamed gRPC request with typed numpy inputs -> (merged outputs dict, error or None)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype
    results = queue.Queue()
    cl = grpcclient.InferenceServerClient(url)
    cl.start_stream(callback=lambda result, error: results.put((result, error)))
    ins = []
    for name, arr in inputs.items():
        wire = "BYTES" if arr.dtype == np.object_ else np_to_triton_dtype(arr.dtype)
        i = grpcclient.InferInput(name, list(arr.shape), wire)
        i.set_data_from_numpy(arr)
        ins.append(i)
    cl.async_stream_infer(model, ins, enable_empty_final_response=True)
    out = {"text": "", "ids": [], "names": set()}
    err = None
    try:
        while True:
            r, e = results.get(timeout=60)
            if e is not None:
                err = str(e)
                break
            resp = r.get_response()
            out["names"] |= {o.name for o in resp.outputs}
            if resp.outputs:
                out["text"] += r.as_numpy("text_output").reshape(-1)[0].decode()
                out["ids"] += r.as_numpy("output_ids").reshape(-1).tolist()
                for k in ("num_input_tokens", "num_output_tokens", "finish_reason"):
                    out[k] = r.as_numpy(k).reshape(-1)[0]
            if resp.parameters["triton_final_response"].bool_param:
                break
    finally:
        cl.stop_stream()
        cl.close()
    return out, err


def s(v):
    return np.array([[v.encode()]], dtype=np.object_)


def test_greedy_constrained_output_over_grpc_and_ensemble_equals_the_engine(built, served):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.guided.params import json_schema
    from tritium.backend.sampling_params import SamplingParams
    engine = LLMEngine(built[0])
    rng = random.Random(7)
    for i in range(4):
        schema = {"type": "object", "properties": {"v": random_schema(rng)}, "required": ["v"],
                  "additionalProperties": False}
        prompt = f"Answer {i} in JSON:"
        ref = engine.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0,
                                                       guided=json_schema(schema, "x")))[0].outputs[0]
        for model in ("tiny", "tiny_ensemble"):
            out, err = grpc_infer(served["grpc"], model, {
                "text_input": s(prompt), "max_tokens": np.array([[48]], dtype=np.int32),
                "temperature": np.array([[0.0]], dtype=np.float32),
                "guided_decoding_guide_type": s("json_schema"), "guided_decoding_guide": s(json.dumps(schema))})
            assert err is None, err
            assert out["text"] == ref.text, (model, schema)
            if model == "tiny":
                assert out["ids"] == ref.token_ids
        if ref.finish_reason == "stop":
            jsonschema.validate(json.loads(ref.text), schema)


def test_the_request_of_tritons_openai_frontend_is_answered(served):
    """_create_trtllm_generate_request's tensors for a chat request with a forced tool (json_schema)."""
    schema = json.dumps(ADD)
    inputs = {"text_input": s("add 2 and 3"), "stream": np.array([[False]]),
              "max_tokens": np.array([[40]], dtype=np.int32), "stop_words": np.array([[b"\n\n"]], dtype=np.object_),
              "top_p": np.array([[1.0]], dtype=np.float32), "temperature": np.array([[0.0]], dtype=np.float32),
              "seed": np.array([[1]], dtype=np.uint64), "exclude_input_in_output": np.array([[True]]),
              "guided_decoding_guide_type": s("json_schema"), "guided_decoding_guide": s(schema),
              "return_num_input_tokens": np.array([[True]]), "return_num_output_tokens": np.array([[True]])}
    out, err = grpc_infer(served["grpc"], "tiny", inputs)
    assert err is None, err
    assert {"num_input_tokens", "num_output_tokens"} <= out["names"]
    assert out["num_input_tokens"] > 0 and out["num_output_tokens"] == len(out["ids"])
    jsonschema.validate(json.loads(out["text"]), ADD)
    # vllm_backend's form, as the frontend sends it to a vLLM model: sampling_parameters JSON
    sp = json.dumps({"max_tokens": 30, "temperature": 0, "structured_outputs": json.dumps({"regex": "[0-9]{4}"})})
    out, err = grpc_infer(served["grpc"], "tiny", {"text_input": s("year?"), "sampling_parameters": s(sp),
                                                    "return_num_input_tokens": np.array([[True]])})
    assert err is None and re.fullmatch("[0-9]{4}", out["text"]), (err, out["text"])
    out, err = grpc_infer(served["grpc"], "tiny", dict(inputs, guided_decoding_guide_type=s("yaml")))
    assert err is not None and "guided_decoding_guide_type" in err and "json_schema" in err


def test_response_format_json_schema_validates_streamed_or_not(client):
    rng = random.Random(3)
    for i in range(6):
        schema = {"type": "object", "properties": {"a": random_schema(rng), "b": random_schema(rng, 1)},
                  "required": ["a", "b"], "additionalProperties": False}
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        args = dict(model="tiny", messages=MESSAGES, response_format=rf, max_tokens=80, temperature=1.0, seed=i)
        r = client.chat.completions.create(**args)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                           if c.choices)
        assert streamed == r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=60, temperature=0.0)
    assert r.choices[0].message.content.startswith("{")


def _check_call(call, name=None):
    assert call.type == "function" and call.id
    if name is not None:
        assert call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _assemble(stream):
    """The tool calls of a stream, assembled from deltas the way the OpenAI SDK documents it."""
    calls, finish = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                if d.function is not None:
                    c["name"] += d.function.name or ""
                    c["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_always_parse_and_stream_the_same(client, choice):
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "add"}}
    for seed in range(4):
        args = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
                    temperature=1.0, seed=seed)
        r = client.chat.completions.create(**args)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        _check_call(ch.message.tool_calls[0], None if choice == "required" else "add")
        calls, finish = _assemble(client.chat.completions.create(stream=True, **args))
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [(t.function.name, json.loads(t.function.arguments)) for t in ch.message.tool_calls]


def test_auto_returns_a_call_or_text_and_tool_messages_are_accepted(client):
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                           max_tokens=30, temperature=1.0, seed=seed)
        m = r.choices[0].message
        assert m.tool_calls or isinstance(m.content, str)
        for c in m.tool_calls or []:
            _check_call(c)
    convo = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model="tiny", messages=convo, tools=TOOLS, max_tokens=8, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kwargs,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format"),
    (dict(response_format={"type": "yaml"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format"),
])
def test_bad_guides_are_400_naming_the_field(client, kwargs, param):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param, e.value.body
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices  # still up


def test_tritium_generate_flags_in_process_and_remote(built, served, tmp_path):
    import contextlib
    import io

    from tritium.client.cli.main import main

    def run(*args):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["generate", "--json", "--max-tokens", "40", *args]) == 0
        return [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.startswith("{")]
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(ADD))
    local = run("--engine", built[0], "--json-schema", str(schema), "add two numbers")[0]
    remote = run("--url", served["grpc"], "--model", "tiny", "--json-schema", str(schema), "add two numbers")[0]
    assert remote["text"] == local["text"] and local["finish_reason"] == "stop"
    jsonschema.validate(json.loads(local["text"]), ADD)
    assert run("--url", served["grpc"], "--model", "tiny", "--choice", "yes", "--choice", "no", "ok?")[0]["text"] \
        in ("yes", "no")
    assert re.fullmatch("[0-9]{3}", run("--engine", built[0], "--regex", "[0-9]{3}", "n?")[0]["text"])
