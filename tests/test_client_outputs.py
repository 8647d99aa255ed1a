"""Which outputs the clients name on a request: TritiumClient's gRPC path asks for the outputs a
Chunk reads (every output when log probs are asked for), the serving benchmark for the three it
reads. The served results are checked against the in-process engine in tests/test_serving_server.py
(test_stream_equals_inprocess_greedy, through NAME, NAME_ensemble and NAME_bls) and
tests/test_bench_serving.py."""
from __future__ import annotations

import json

from tritium.backend.triton_backend.contract import OUTPUTS
from tritium.builder.repository import _ENSEMBLE_LLM_OUTPUTS
from tritium.client.bench.bench_drivers import REQUESTED_OUTPUTS
from tritium.client.triton_client import READ_OUTPUTS, build_request, wants_log_probs


def test_named_outputs_exist_on_every_served_model():
    llm = {s.name for s in OUTPUTS}
    ensemble = {s.name for s in _ENSEMBLE_LLM_OUTPUTS} | {"text_output"}
    assert set(READ_OUTPUTS) <= llm and set(READ_OUTPUTS) <= ensemble  # the BLS model has OUTPUTS
    assert set(REQUESTED_OUTPUTS) <= llm and set(REQUESTED_OUTPUTS) <= ensemble
    assert "batch_index" not in READ_OUTPUTS and "context_ids" not in READ_OUTPUTS


def test_log_probs_requests_ask_for_everything():
    assert not wants_log_probs(build_request("hi", max_tokens=4))
    assert not wants_log_probs(build_request("hi", return_log_probs=False))
    assert wants_log_probs(build_request("hi", return_log_probs=True))
    assert wants_log_probs(build_request("hi", sampling_parameters=json.dumps({"logprobs": 2})))
    assert not wants_log_probs(build_request("hi", sampling_parameters=json.dumps({"ignore_eos": True})))
    assert wants_log_probs(build_request("hi", sampling_parameters="{not json"))  # the server names the error
