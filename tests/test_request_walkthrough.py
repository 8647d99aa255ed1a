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

The backend writes the SamplingParams each admitted request reaches the engine with
(TRITIUM_REQUEST_LOG), so "the engine receives the same SamplingParams" is read from the server,
not recomputed here. A bad value gets the same error code naming the same field on every surface
(the OpenAI API names it by its OpenAI parameter, looked up in the schema).
"""
from __future__ import annotations

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
    "logprobs": 2, "n": 2, "logit_bias": {5: -1.5},
}
BAD = {
    "max_tokens": 0, "temperature": 2.5, "top_k": -5, "top_p": 1.5, "min_p": 1.5, "repetition_penalty": 0.0,
    "presence_penalty": 3.0, "frequency_penalty": -3.0, "seed": 2 ** 63, "min_tokens": -1, "ignore_eos": "yes",
    "stop": ["s"] * 33, "stop_token_ids": [-1], "bad_words": ["w" * 129], "logprobs": 21, "n": 65,
    "logit_bias": {5: 150.0},
}
PROMPT = "The quick brown fox"
# The adapter a request picks (lora_name, lora_task_id) is judged against the adapters the engine
# serves, so a value good on one server is bad on another: tests/test_lora_serving.py walks them
# through tensors, sampling_parameters and the OpenAI API (adapters as models), and
# tests/test_lora_errors.py their errors (bad_parameter naming the field).
ADAPTER_FIELDS = {"lora_name", "lora_task_id"}


def test_every_field_is_walked():
    assert set(GOOD) == set(BAD) == {f.name for f in FIELDS} - ADAPTER_FIELDS
    expected = SamplingParams(**GOOD)
    for name, v in GOOD.items():
        assert v != FIELD[name].default, f"{name}: pick a value that is not the default"
        assert getattr(expected, name) == v
    for name, v in BAD.items():
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
    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("walk")
    engine, repo = str(root / "engine"), str(root / "repo")
    assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--max-batch-size", "8",
                 "--quiet", "--repo", repo, "--name", "tiny"]) == 0
    log = str(root / "requests.jsonl")
    env = dict(os.environ, TRITIUM_CACHE=str(root / "cache"), TRITIUM_REQUEST_LOG=log)
    with tritium_serve(repo, root, env=env) as (proc, lines):
        s = Served(proc, "".join(lines), log)
        s.engine = engine
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
    kw, extra = {}, {}
    for k, v in fields.items():
        name = FIELD[k].openai or k  # logprobs: the completions endpoint's own parameter
        v = {str(t): b for t, b in v.items()} if FIELD[k].kind == "bias" else v
        (kw if k in std else extra)[name] = v
    client.completions.create(model="tiny", prompt=PROMPT, extra_body=extra or None, **kw)
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
    """`tritium generate --engine`: the SamplingParams its engine's add_request receives."""
    from tritium.backend.engine import LLMEngine
    from tritium.client.cli.main import build_parser
    got = []
    real = LLMEngine.add_request

    def spy(self, request_id, prompt=None, prompt_token_ids=None, params=None, priority=0, **lora):
        got.append(params)
        return real(self, request_id, prompt, prompt_token_ids, params, priority, **lora)
    args = build_parser().parse_args(["generate", "--engine", served.engine, "--json", "--num-kv-blocks", "64",
                                      PROMPT, *_cli_args(fields)])
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
    got = SURFACES[surface](served, GOOD)
    assert got == _given(GOOD, cli), surface
    for name, v in GOOD.items():
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
    except openai.BadRequestError as e:
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
        code, field = _error(surface, served, {name: v})
        if surface == "openai":
            assert (code, field) == (OPENAI_CODE_OF["bad_parameter"], openai_param(name, "completion")), name
        else:
            assert (code, field) == ("bad_parameter", name), (surface, name)
    # a value that only the engine can judge: max_tokens beyond the context (too_long, max_tokens)
    code, field = _error(surface, served, {"max_tokens": 10 ** 6})
    want = ("context_length_exceeded", "max_tokens") if surface == "openai" else ("too_long", "max_tokens")
    assert (code, field) == want, surface
    capsys.readouterr()
