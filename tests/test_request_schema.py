"""The request-field schema, the error contract and the engine-options table, without a server.

Oracles: the schema's own declarations (each surface must expose exactly the names it declares),
json for the wire form of errors, and argparse / config.pbtxt strings for the options.
"""
from __future__ import annotations

import argparse
import json

import pytest

from tritium.backend.async_engine import EngineOverloadedError
from tritium.backend.engine_options import (OPTION, SPECULATIVE, add_option_arguments, engine_setup, options_from_args,
                                            options_from_params, to_params)
from tritium.backend.errors import RequestError, TritiumError, error_info, from_wire, to_wire
from tritium.backend.sampling_params import FIELD, FIELDS, SamplingParams


def test_every_surface_exposes_exactly_the_declared_names():
    from tritium.backend.triton_backend.contract import INPUTS
    from tritium.client.cli.main import build_parser
    from tritium.client.cli.generate_inputs import FILE_KEYS
    inputs = {s.name: s for s in INPUTS}
    for f in FIELDS:
        if f.tensor:
            assert inputs[f.tensor].data_type == f.wire_type and f.name in inputs[f.tensor].doc
    assert {f.json_key for f in FIELDS if f.json_key} <= FILE_KEYS
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    flags = {o for a in gen._actions for o in a.option_strings}
    assert {f.cli for f in FIELDS if f.cli} <= flags
    dests = {a.dest for a in gen._actions}
    assert {f.name for f in FIELDS if f.cli} <= dests


def test_one_stop_normalization_and_greedy():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["", "y", ""]).stop == ["y"]  # padding / empty strings dropped, never refused
    assert SamplingParams(bad_words="w").bad_words == ["w"]
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(top_k=0).top_k is None and SamplingParams(top_k=-1).top_k is None


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=2.5), "temperature"), (dict(top_k=True), "top_k"), (dict(seed=1.5), "seed"),
    (dict(stop=[1]), "stop"), (dict(logit_bias={"x": 1}), "logit_bias"), (dict(min_tokens=20), "min_tokens"),
    (dict(max_tokens=None, n=0), "n"), (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_a_built_sampling_params_is_checked(kw, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field and e.value.code == "bad_parameter" and field in e.value.message


def test_context_checks_say_too_long():
    sp = SamplingParams(max_tokens=10)
    with pytest.raises(RequestError) as e:
        sp.check_context(max_seq_len=16, vocab_size=100, prompt_len=8)
    assert (e.value.code, e.value.field) == ("too_long", "max_tokens")
    with pytest.raises(RequestError) as e:
        sp.check_context(max_seq_len=16, vocab_size=100, prompt_len=16)
    assert (e.value.code, e.value.field) == ("too_long", "prompt")


def test_errors_cross_the_wire_as_json():
    for exc in (RequestError("n must be in [1, 64], got 0", field="n"), EngineOverloadedError("full"),
                RequestError("{braces} in a message", field="stop", code="too_long")):
        info = error_info(exc)
        back = from_wire("in ensemble 'm_ensemble', {not json} " + to_wire(exc, "batch row 1: "))
        assert (back.code, back.field) == (info["code"], info["field"])
        assert back.message == "batch row 1: " + info["message"]
    assert error_info(ZeroDivisionError("x")) == {"code": "internal", "field": None, "message": "ZeroDivisionError: x"}
    assert error_info(ValueError("plain")) == {"code": "bad_parameter", "field": None, "message": "plain"}
    with pytest.raises(AssertionError):
        TritiumError("x", code="no_such_code")
    assert json.loads(to_wire(RequestError("m", field="top_p")))["field"] == "top_p"


def test_engine_options_read_the_same_from_flags_and_config_pbtxt(tmp_path):
    p = argparse.ArgumentParser()
    add_option_arguments(p, ("num_kv_blocks", "max_num_seqs") + SPECULATIVE, "engine")
    args = p.parse_args(["--num-kv-blocks", "8", "--max-num-seqs", "4", "--speculative", "draft", "--draft-engine",
                         "d", "--num-speculative-tokens", "3"])
    from_cli = options_from_args(args, ("num_kv_blocks", "max_num_seqs") + SPECULATIVE)
    from_pbtxt = options_from_params(to_params(from_cli))
    assert from_cli == from_pbtxt == {"num_kv_blocks": 8, "max_num_seqs": 4, "speculative_method": "draft",
                                      "draft_engine_dir": "d", "num_speculative_tokens": 3}
    setup = engine_setup(from_pbtxt, base_dir=str(tmp_path))
    spec = setup.engine_kwargs["speculative"]
    assert spec.draft_engine_dir == str(tmp_path / "d") and spec.num_speculative_tokens == 3
    assert setup.thread_policy is None and setup.max_queue_size is None  # in-process: torch's threads as they are
    server = engine_setup({}, server=True)
    assert server.thread_policy is not None and server.max_queue_size == 1024


@pytest.mark.parametrize("params,needle", [
    ({"num_kv_blocks": "many"}, "parameter num_kv_blocks must be an integer"),
    ({"num_kv_blocks": "0"}, "parameter num_kv_blocks must be an integer in [1, inf]"),
    ({"enable_prefix_caching": "maybe"}, "parameter enable_prefix_caching must be true or false"),
    ({"speculative_method": "medusa"}, "parameter speculative_method must be one of ngram, draft"),
    ({"num_speculative_tokens": "17", "speculative_method": "ngram"}, "must be an integer in [1, 16]"),
])
def test_bad_engine_options_name_the_parameter(params, needle):
    with pytest.raises(ValueError) as e:
        engine_setup(options_from_params(params))
    assert needle in str(e.value)


def test_option_table_names_are_unique():
    assert len({o.cli for o in OPTION.values()}) == len(OPTION)
    assert len({f.cli for f in FIELDS if f.cli}) == len([f for f in FIELDS if f.cli])
    assert not {o.cli for o in OPTION.values()} & {f.cli for f in FIELDS}
    assert FIELD["n"].tensor == "num_return_sequences"
