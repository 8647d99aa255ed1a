"""Walk every request field of the schema through every surface, to the engine.

For each field of SamplingParams (the one declaration, backend/sampling_params.py) a valid
non-default value and a bad one are listed below; adding a field without listing it here fails
test_every_field_is_walked. The surfaces are the real ones: one `tritium serve` for the module
(tritonserver + the OpenAI API), reached by

  - Triton tensors (tritonclient gRPC, the contract's dtypes), with sampling_parameters JSON for
    the fields that have no tensor,
  - vllm_backend's sampling_parameters JSON alone,
  - the OpenAI API through the official `openai` package (vLLM's extra fields in extra_body),
  - `tritium generate --url` (remote) and `tritium generate --engine` (in-process).

The model serves one LoRA adapter (`tritium build --repo --lora ad1=PATH`, a random rank-2 PEFT
adapter), so lora_name / lora_task_id are walked too: on the OpenAI API the adapter is the `model`
(an unknown one is 404 model_not_found, param model), `tritium generate --engine` serves it with
`--lora ad1=PATH`, and lora_task_id (a Triton tensor only) travels with its lora_weights / lora_config.

The backend writes the SamplingParams each admitted request reaches the engine with
(TRITIUM_REQUEST_LOG), so "the engine receives the same SamplingParams" is read from the server,
not recomputed here. A bad value gets the same error code naming the same field on every surface
(the OpenAI API names it by its OpenAI parameter, looked up in the schema).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import pytest

from serving_utils import tritium_serve

from tritium.backend.errors import RequestError
from tritium.backend.sampling_params import FIELD, FIELDS, SamplingParams

pytestmark = pytest.mark.slow

# Values exact in float32 (Triton's FP32 tensors), so every surface can deliver them bit for bit.
GOOD = {
    "max_tokens": 5, "temperature": 0.5, "top_k": 7, "top_p": 0.875, "min_p": 0.0625,
    "repetition_penalty": 1.125, "presence_penalty": 0.5, "frequency_penalty": 0.25, "seed": 1234,
    "min_tokens": 2, "ignore_eos": True, "stop": ["zz"], "stop_token_ids": [3], "bad_words": ["qq"],
    "logprobs": 2, "n": 2, "logit_bias": {5: -1.5}, "lora_name": "ad1", "lora_task_id": 41,
}
BAD = {
    "max_tokens": 0, "temperature": 2.5, "top_k": -5, "top_p": 1.5, "min_p": 1.5, "repetition_penalty": 0.0,
    "presence_penalty": 3.0, "frequency_penalty": -3.0, "seed": 2 ** 63, "min_tokens": -1, "ignore_eos": "yes",
    "stop": ["s"] * 33, "stop_token_ids": [-1], "bad_words": ["w" * 129], "logprobs": 21, "n": 65,
    "logit_bias": {5: 150.0}, "lora_name": "nope", "lora_task_id": 42,
}
PROMPT = "The quick brown fox"
# The adapter a request picks is judged against the adapters the engine serves (the module's
# server serves one, "ad1"): lora_name "nope" is unknown, lora_task_id 42 was never sent. A request
# names one adapter, so the all-fields request leaves lora_task_id out (it is walked alone), and
# lora_task_id 41 travels with its lora_weights / lora_config (tensorrtllm_backend's first use).
ADAPTER_FIELDS = {"lora_name", "lora_task_id"}
ALL = {k: v for k, v in GOOD.items() if k != "lora_task_id"}
# Fields a surface has no spelling for, by the schema (checked, not skipped quietly: see spelled()).
UNSPELLED = {"tensors": set(), "json": {"lora_task_id"}, "openai": {"lora_task_id"},
             "cli_remote": {"lora_task_id"}, "cli_engine": {"lora_task_id"}}


def spelled(surface: str, name: str) -> bool:
    """Does the schema give `name` a spelling on this surface? (asserted against UNSPELLED)"""
    f = FIELD[name]
    has = {"tensors": bool(f.tensor or f.json_key), "json": bool(f.json_key), "openai": bool(f.openai or f.json_key),
           "cli_remote": bool(f.cli), "cli_engine": bool(f.cli)}[surface]
    assert has == (name not in UNSPELLED[surface]), (surface, name)
    return has


def test_every_field_is_walked():
    assert set(GOOD) == set(BAD) == {f.name for f in FIELDS}
    expected = SamplingParams(**ALL)
    for name, v in GOOD.items():
        assert v != FIELD[name].default, f"{name}: pick a value that is not the default"
        assert getattr(expected if name in ALL else SamplingParams(**{name: v}), name) == v
    for name, v in BAD.items():
        if name in ADAPTER_FIELDS:  # well-formed: only the engine, which knows its adapters, refuses it
            assert getattr(SamplingParams(**{name: v}), name) == v
            continue
        with pytest.raises(RequestError) as e:
            SamplingParams(**{name: v})
        assert e.value.field == name and e.value.code == "bad_parameter"


# ---- one server for the module -------------------------------------------------------------------
class Served:
    def __init__(self, proc, text, log):
        self.proc = proc
        self.grpc = re.search(r"gRPC (\S+)", text).group(1)
        self.openai = re.search(r"OpenAI API: (\S+)", text).group(1)
        self.log = log

    def mark(self) -> None:
        """Forget what the backend logged so far (received() then waits for new rows)."""
        self.seen = len(open(self.log, encoding="utf-8").read().splitlines()) if os.path.exists(self.log) else 0

    def received(self, count: int):
        """The SamplingParams of the last `count` rows the backend admitted (waits for them)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lines = open(self.log, encoding="utf-8").read().splitlines() if os.path.exists(self.log) else []
            if len(lines) >= self.seen + count:
                new, self.seen = lines[self.seen:self.seen + count], self.seen + count
                return [SamplingParams(**json.loads(ln)) for ln in new]
            time.sleep(0.05)
        raise AssertionError("the backend logged no admitted request")

    seen = 0


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from lora_utils import make_peft_adapter
    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("walk")
    engine, repo, adapter = str(root / "engine"), str(root / "repo"), str(root / "ad1")
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32)
    make_peft_adapter(base, adapter, r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--max-batch-size", "8",
                 "--quiet", "--repo", repo, "--name", "tiny", "--lora", f"ad1={adapter}"]) == 0
    log = str(root / "requests.jsonl")
    env = dict(os.environ, TRITIUM_CACHE=str(root / "cache"), TRITIUM_REQUEST_LOG=log)
    with tritium_serve(repo, root, env=env) as (proc, lines):
        s = Served(proc, "".join(lines), log)
        s.engine, s.adapter = engine, adapter
        yield s


# ---- the surfaces: each sends {field: value} and returns (SamplingParams received | error) ---------
def _wire(fields: dict) -> dict:
    """{json key: value} (logit_bias keys as JSON object keys)."""
    return {FIELD[k].json_key: ({str(t): b for t, b in v.items()} if FIELD[k].kind == "bias" else v)
            for k, v in fields.items()}


def via_tensors(served, fields: dict):
    """Fields with a Triton input as tensors (the contract's dtypes), the others in sampling_parameters."""
    from tritium.client.triton_client import TritiumClient
    tensors = {FIELD[k].tensor: v for k, v in fields.items() if FIELD[k].tensor}
    rest = {k: v for k, v in fields.items() if not FIELD[k].tensor}
    if "logprobs" in rest:
        tensors["return_log_probs"] = True
    if rest:
        tensors["sampling_parameters"] = json.dumps(_wire(rest))
    if fields.get("lora_task_id") == GOOD["lora_task_id"]:  # with its weights every time (the same weights
        # re-cache the same id); BAD's id comes alone, never sent before
        from test_lora_peft import trtllm_tensors
        w, cfg = trtllm_tensors(served.adapter)
        tensors.update(lora_weights=w[0], lora_config=cfg[0])
    TritiumClient(served.grpc, model="tiny").generate_all(PROMPT, **tensors)
    return served.received(1)[0]


def via_json(served, fields: dict):
    from tritium.client.triton_client import TritiumClient
    extra = {"return_log_probs": True} if "logprobs" in fields else {}
    TritiumClient(served.grpc, model="tiny").generate_all(PROMPT, sampling_parameters=json.dumps(_wire(fields)),
                                                          **extra)
    return served.received(1)[0]


def via_openai(served, fields: dict):
    """/v1/completions with the official client: OpenAI's names first, vLLM's extensions in extra_body."""
    import openai
    client = openai.OpenAI(base_url=served.openai, api_key="unused", max_retries=0, timeout=120)
    std = ("max_tokens", "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "stop", "n",
           "logit_bias", "logprobs")
    kw, extra, model = {}, {}, "tiny"
    for k, v in fields.items():
        if k == "lora_name":  # an adapter is a model of its own (parent: the LLM model)
            model = v
            continue
        name = FIELD[k].openai or k  # logprobs: the completions endpoint's own parameter
        v = {str(t): b for t, b in v.items()} if FIELD[k].kind == "bias" else v
        (kw if k in std else extra)[name] = v
    client.completions.create(model=model, prompt=PROMPT, extra_body=extra or None, **kw)
    return served.received(1)[0]


def _cli_args(fields: dict) -> list:
    out = []
    for k, v in fields.items():
        f = FIELD[k]
        if f.kind == "bool":
            assert v is True
            out.append(f.cli)
        elif f.kind in ("words", "ids"):
            for w in v:
                out += [f.cli, str(w)]
        elif f.kind == "bias":
            out += [f.cli, json.dumps({str(t): b for t, b in v.items()})]
        else:
            out += [f.cli, str(v)]
    return out


def via_cli_remote(served, fields: dict):
    from tritium.client.cli.main import build_parser
    args = build_parser().parse_args(["generate", "--url", served.grpc, "--model", "tiny", "--json", PROMPT,
                                      *_cli_args(fields)])
    args.func(args)
    return served.received(1)[0]


def via_cli_engine(served, fields: dict):
    """`tritium generate --engine`: the SamplingParams its engine's add_request receives, with the
    adapter add_request is given beside them (--lora ad1=PATH serves it in-process)."""
    from tritium.backend.engine import LLMEngine
    from tritium.client.cli.main import build_parser
    got = []
    real = LLMEngine.add_request

    def spy(self, request_id, prompt=None, prompt_token_ids=None, params=None, priority=0, **lora):
        got.append(dataclasses.replace(params, lora_name=lora.get("lora_name") or params.lora_name,
                                       lora_task_id=lora.get("lora_task_id") or params.lora_task_id))
        return real(self, request_id, prompt, prompt_token_ids, params, priority, **lora)
    args = build_parser().parse_args(["generate", "--engine", served.engine, "--json", "--num-kv-blocks", "64",
                                      PROMPT, *_cli_args(fields),
                                      *(["--lora", f"ad1={served.adapter}"] if "lora_name" in fields else [])])
    LLMEngine.add_request = spy
    try:
        args.func(args)
    finally:
        LLMEngine.add_request = real
    return got[0]


SURFACES = {"tensors": via_tensors, "json": via_json, "openai": via_openai, "cli_remote": via_cli_remote,
            "cli_engine": via_cli_engine}


def _given(fields: dict, defaults_of_cli: bool) -> SamplingParams:
    """What the engine must get: the fields sent, the schema's defaults for the rest (and the CLI's
    own defaults where the schema declares them: temperature 0)."""
    kw = dict(fields)
    if defaults_of_cli:
        for f in FIELDS:
            if f.name not in kw and f.cli and f.default_for_cli != f.default:
                kw[f.name] = f.default_for_cli
    return SamplingParams(**kw)


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_every_field_reaches_the_engine_unchanged(served, surface, capsys):
    """All fields at once, then each field alone (so no field hides behind another's default)."""
    cli = surface.startswith("cli")
    served.mark()
    every = {k: v for k, v in ALL.items() if spelled(surface, k)}
    got = SURFACES[surface](served, every)
    assert got == _given(every, cli), surface
    for name, v in GOOD.items():
        if not spelled(surface, name):
            continue
        fields = {name: v, "max_tokens": GOOD["max_tokens"]} if name != "max_tokens" else {name: v}
        got = SURFACES[surface](served, fields)
        assert got == _given(fields, cli), (surface, name)
    capsys.readouterr()


def _error(surface, served, fields):
    """(code, field) of the error a bad value gets on this surface."""
    import openai
    served.mark()
    try:
        SURFACES[surface](served, fields)
    except openai.APIStatusError as e:
        return e.body["code"], e.body["param"]
    except Exception as e:
        return getattr(e, "code", None), getattr(e, "field", None)
    raise AssertionError(f"{surface}: {fields} was accepted")


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_a_bad_value_gets_the_same_code_and_field_everywhere(served, surface, capsys):
    from tritium.client.openai.openai_protocol import OPENAI_CODE_OF, openai_param
    for name, v in BAD.items():
        if surface.startswith("cli") and FIELD[name].kind == "bool":
            continue  # a flag without a value: nothing out of range can be typed
        if not spelled(surface, name):
            continue
        code, field = _error(surface, served, {name: v})
        if surface == "openai" and name == "lora_name":  # the adapter is the model: unknown, 404
            assert (code, field) == ("model_not_found", "model")
        elif surface == "openai":
            assert (code, field) == (OPENAI_CODE_OF["bad_parameter"], openai_param(name, "completion")), name
        else:
            assert (code, field) == ("bad_parameter", name), (surface, name)
    # a value that only the engine can judge: max_tokens beyond the context (too_long, max_tokens)
    code, field = _error(surface, served, {"max_tokens": 10 ** 6})
    want = ("context_length_exceeded", "max_tokens") if surface == "openai" else ("too_long", "max_tokens")
    assert (code, field) == want, surface
    capsys.readouterr()
