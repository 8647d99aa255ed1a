"""Unit tests of the serving pieces that need no server: request parsing, repository configs
(checked against Triton's own ModelConfig protobuf schema), stateless streaming detokenization."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tritium.backend.sampling_params import SamplingParams
from tritium.backend.triton_backend.contract import INPUTS, OUTPUTS, token_logprobs
from tritium.backend.triton_backend.request import batch_size_of, parse_row, parse_sampling_parameters

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _req(**kw):
    """Input arrays as Triton hands them over: batch dimension first."""
    out = {}
    for k, v in kw.items():
        if isinstance(v, np.ndarray):
            out[k] = v
        elif isinstance(v, str):
            out[k] = np.array([[v.encode()]], dtype=np.object_)
        elif isinstance(v, bool):
            out[k] = np.array([[v]], dtype=np.bool_)
        elif isinstance(v, int):
            out[k] = np.array([[v]], dtype=np.int32)
        elif isinstance(v, float):
            out[k] = np.array([[v]], dtype=np.float32)
        else:
            raise TypeError(k)
    return out


def parse(**kw):
    a = _req(**kw)
    return parse_row(a, 0, batch_size_of(a), vocab_size=1000)


def test_defaults_and_mapping():
    p = parse(text_input="héllo", max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, num_return_sequences=2,
              end_id=7, stream=True)
    assert p.prompt == "héllo" and p.prompt_token_ids is None
    assert p.params == {"max_tokens": 5, "temperature": 0.5, "top_k": 3, "top_p": pytest.approx(0.9), "n": 2,
                        "stop_token_ids": [7]}
    assert p.stream and p.exclude_input_in_output and not p.return_log_probs
    q = parse(text_input="x")
    assert q.params == {"max_tokens": 16} and not q.stream


def test_input_ids_with_lengths_and_words():
    a = {"input_ids": np.array([[5, 6, 7, 0]], dtype=np.int32), "input_lengths": np.array([[3]], dtype=np.int32),
         "stop_words": np.array([[b"END", b""]], dtype=np.object_), "return_log_probs": np.array([[True]])}
    p = parse_row(a, 0, 1, vocab_size=1000)
    # empty strings are padding in tensorrtllm_backend clients: SamplingParams drops them (the one rule)
    assert p.prompt_token_ids == [5, 6, 7] and p.sampling.stop == ["END"] and p.params["logprobs"] == 0
    assert p.return_log_probs


def test_batch_rows_and_broadcast():
    a = {"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_), "max_tokens": np.array([[4]], dtype=np.int32)}
    rows = [parse_row(a, r, batch_size_of(a)) for r in range(2)]
    assert [r.prompt for r in rows] == ["a", "b"] and all(r.params["max_tokens"] == 4 for r in rows)
    a["temperature"] = np.zeros((3, 1), dtype=np.float32)
    with pytest.raises(ValueError, match="temperature"):
        parse_row(a, 0, 2)


@pytest.mark.parametrize("kw,field", [
    (dict(max_tokens=3), "text_input"),
    (dict(text_input=""), "text_input"),
    (dict(text_input="x", max_tokens=0), "max_tokens"),
    (dict(text_input="x", max_tokens=-4), "max_tokens"),
    (dict(text_input="x", temperature=float("nan")), "temperature"),
    (dict(text_input="x", top_p=float("inf")), "top_p"),
    (dict(text_input="x", num_return_sequences=0), "num_return_sequences"),
    (dict(text_input="x", end_id=5000), "end_id"),
    (dict(text_input="x", sampling_parameters='{"best_of": 2}'), "best_of"),
    (dict(text_input="x", sampling_parameters='{"temperature": "hot"}'), "temperature"),
    (dict(text_input="x", sampling_parameters='[1]'), "sampling_parameters"),
    (dict(text_input="x", temperature=np.array([[1]], dtype=np.int32)), "temperature"),
    (dict(text_input="x", stream=np.array([[1]], dtype=np.int32)), "stream"),
    (dict(input_ids=np.array([[1, 2000]], dtype=np.int32)), "input_ids"),
    (dict(text_input="x", bogus=1), "bogus"),
])
def test_bad_inputs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        parse(**kw)


def test_sampling_parameters_vllm_strings():
    d = parse_sampling_parameters(json.dumps({"temperature": "0.25", "top_k": "4", "stop": "###",
                                              "ignore_eos": "true", "n": 2}))
    assert d == {"temperature": 0.25, "top_k": 4, "stop": "###", "ignore_eos": True, "n": 2}
    sp = SamplingParams(**d)  # the one place a stop string becomes a list
    assert sp.stop == ["###"] and sp.top_k == 4 and sp.ignore_eos is True
    # tensors override the JSON
    p = parse(text_input="x", sampling_parameters='{"temperature": 0.9, "max_tokens": 3}', temperature=0.0)
    assert p.params["temperature"] == 0.0 and p.params["max_tokens"] == 3


def test_token_logprobs_forms():
    assert token_logprobs([{"token_id": 3, "logprob": -1.5}], [3]) == [-1.5]
    assert token_logprobs([{3: -0.5}], [3]) == [-0.5]
    assert token_logprobs(None, [3]) == []


# ---- repository: configs parse with Triton's ModelConfig schema ---------------------------------
def _parse_pbtxt(path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2
    with open(path) as f:
        return text_format.Parse(f.read(), model_config_pb2.ModelConfig())


def test_repository_configs_follow_triton_schema(tmp_path):
    from tritium.builder.repository import write_repository
    names = write_repository(str(tmp_path), "m", str(tmp_path / "eng"), max_batch_size=8)
    assert names == ["m", "m_preprocessing", "m_postprocessing", "m_ensemble", "m_bls"]
    llm = _parse_pbtxt(tmp_path / "m" / "config.pbtxt")
    assert llm.backend == "tritium" and llm.max_batch_size == 8 and llm.model_transaction_policy.decoupled
    assert [i.name for i in llm.input] == [s.name for s in INPUTS]
    assert [o.name for o in llm.output] == [s.name for s in OUTPUTS]
    assert llm.parameters["engine_dir"].string_value == "../eng"  # inside the repo: relative
    ens = _parse_pbtxt(tmp_path / "m_ensemble" / "config.pbtxt")
    assert ens.platform == "ensemble"
    assert [s.model_name for s in ens.ensemble_scheduling.step] == ["m_preprocessing", "m", "m_postprocessing"]
    # every step input after the decoupled LLM comes from the LLM (Triton's ensemble rule)
    llm_outs = set(ens.ensemble_scheduling.step[1].output_map.values())
    assert set(ens.ensemble_scheduling.step[2].input_map.values()) <= llm_outs
    bls = _parse_pbtxt(tmp_path / "m_bls" / "config.pbtxt")
    assert bls.model_transaction_policy.decoupled and bls.parameters["llm_model"].string_value == "m"
    for sub in ("m_preprocessing", "m_postprocessing", "m_bls"):
        assert "TritonPythonModel" in (tmp_path / sub / "1" / "model.py").read_text()


def test_checked_in_example_is_the_writer_output(tmp_path):
    from tritium.builder.repository import write_repository
    write_repository(str(tmp_path), "smollm2", "~/.cache/tritium/engines/smollm2-135m-instruct", max_batch_size=64)
    example = os.path.join(REPO_ROOT, "model_repository")
    for root, _, files in os.walk(tmp_path):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), tmp_path)
            with open(os.path.join(example, rel)) as a, open(os.path.join(root, f)) as b:
                assert a.read() == b.read(), rel


def test_bad_name_rejected(tmp_path):
    from tritium.builder.repository import write_repository
    with pytest.raises(ValueError, match="--name"):
        write_repository(str(tmp_path), "a b", "/x", max_batch_size=1)


# ---- stateless streaming detokenization (postprocessing model) ---------------------------------
def test_decode_delta_joins_to_full_decode():
    from tiny_models import train_tokenizer
    from tritium.backend.triton_backend.contract import NUM_CONTEXT_IDS
    from tritium.backend.triton_backend.tokenizer_models import decode_delta
    tok = train_tokenizer(1000)
    rng = np.random.default_rng(0)
    texts = ["naïve café — 日本語のテキスト 🙂🚀 ok", "Ünïcödé ∑ λ → 🙃 end"]
    alphabet = list("abc xyz.,日本語のテキスト京都🙂🚀🙃éüñ—∑λ→")
    texts += ["".join(rng.choice(alphabet, 30)) for _ in range(20)]  # random valid UTF-8 text
    id_lists = [tok.encode(t).ids for t in texts]
    # random ids: malformed UTF-8 (lone lead / continuation bytes) split across tokens anyhow
    id_lists += [list(rng.integers(0, tok.get_vocab_size(), 40)) for _ in range(40)]
    for ids in id_lists:
        ids = [int(i) for i in ids]
        sent, pieces = [], []
        for k, i in enumerate(ids):
            pieces.append(decode_delta(tok, sent[-NUM_CONTEXT_IDS:], [i], final=k == len(ids) - 1))
            sent.append(i)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_response_arrays_build_only_the_requested_outputs():
    """Every output of the contract (OUTPUTS) with its Triton type and batch dimension 1; with
    names, only those; per-stream constants are passed through as given."""
    from tritium.backend.triton_backend.contract import response_arrays
    kinds = {"TYPE_STRING": np.object_, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32}
    full = response_arrays(text="é!", new_ids=[5, 6], finish_reason=None, cum_log_prob=None, log_probs=[],
                           num_input_tokens=7, num_output_tokens=2, batch_index=1, sequence_index=0,
                           context_ids=[3])
    specs = {s.name: s for s in OUTPUTS}
    assert set(full) == set(specs) - {"logprobs_detail"}  # logprobs_detail only when given
    for name, a in full.items():
        assert a.dtype == kinds[specs[name].data_type] and a.shape[0] == 1, name
    assert full["text_output"][0, 0].decode("utf-8") == "é!" and full["finish_reason"][0, 0] == b""
    assert full["output_ids"].tolist() == [[5, 6]] and full["context_ids"].tolist() == [[3]]
    assert full["output_log_probs"].shape == (1, 0) and full["cum_log_probs"].tolist() == [[0.0]]
    assert [full[k].tolist() for k in ("num_input_tokens", "num_output_tokens", "batch_index", "sequence_index")] \
        == [[[7]], [[2]], [[1]], [[0]]]
    const = np.array([[7]], dtype=np.int32)
    some = response_arrays(text="x", new_ids=[], finish_reason="stop", cum_log_prob=-1.5, log_probs=[-0.5],
                           num_input_tokens=7, num_output_tokens=3, batch_index=0, sequence_index=0,
                           context_ids=[], logprobs_detail="[]",
                           names={"output_ids", "finish_reason", "num_input_tokens", "cum_log_probs"},
                           constants={"num_input_tokens": const})
    assert set(some) == {"output_ids", "finish_reason", "num_input_tokens", "cum_log_probs"}
    assert some["output_ids"].shape == (1, 0) and some["finish_reason"][0, 0] == b"stop"
    assert some["num_input_tokens"] is const and some["cum_log_probs"].tolist() == [[-1.5]]
