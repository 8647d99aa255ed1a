"""The delivery thread's TensorCache (backend/triton_backend/tensor_cache.py) and RowStream's
cached responses (stream.py _emit_cached): every response carries exactly the arrays the
contract's builder (contract.response_arrays) makes for it, whether its Tensors came from the
cache or were built, and repeated values are built once. The real tritonserver path is covered by
tests/test_serving_server.py and tests/test_serving_coalesce.py (greedy outputs against the
in-process engine, one token per response)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from tritium.backend.triton_backend.contract import OUTPUTS, response_arrays
from tritium.backend.triton_backend.stream import RequestState, RowStream
from tritium.backend.triton_backend.tensor_cache import MAX_TEXT_BYTES, TensorCache


class FakeTensor:
    built = 0

    def __init__(self, name, a):
        FakeTensor.built += 1
        self.name, self.a = name, np.array(a, copy=True)


class FakePb:
    Tensor = FakeTensor
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors, self.error = list(output_tensors), error


class FakeRequest:
    def __init__(self, names):
        self.names, self.sent = names, []

    def requested_output_names(self):
        return self.names

    def get_response_sender(self):
        req = self

        class Sender:
            def send(self, response=None, flags=0):
                req.sent.append((response, flags))
        return Sender()


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
    assert a.tolist() == b.tolist()


def test_cache_keys_and_bound():
    cache = TensorCache(FakeTensor, limit=3)
    ids = np.array([[5]], dtype=np.int32)
    t = cache.tensor("output_ids", ids)
    assert cache.tensor("output_ids", np.array([[5]], dtype=np.int32)) is t      # equal value: same Tensor
    assert cache.tensor("num_output_tokens", ids) is not t                       # another output
    assert cache.tensor("output_ids", np.array([[6]], dtype=np.int32)) is not t  # another value
    assert len(cache) == 3 and cache.hits == 1 and cache.misses == 3
    cache.tensor("output_ids", np.array([[7]], dtype=np.int32))                  # full: cleared first
    assert len(cache) == 1
    # not cached: floats, longer int rows, long text, arrays that are not one batch row
    for name, a in (("cum_log_probs", np.array([[0.5]], dtype=np.float32)),
                    ("context_ids", np.arange(8, dtype=np.int32).reshape(1, -1)),
                    ("text_output", np.array([[b"x" * (MAX_TEXT_BYTES + 1)]], dtype=np.object_)),
                    ("output_ids", np.array([5], dtype=np.int32))):
        assert TensorCache.key(name, a) is None
        assert cache.tensor(name, a) is not cache.tensor(name, a)
    assert TensorCache.key("text_output", np.array([["é".encode()]], dtype=np.object_)) == ("text_output", "é".encode())


def _output(index, token_ids, new_ids, text, delta, finish=None):
    c = types.SimpleNamespace(index=index, token_ids=list(token_ids), new_token_ids=list(new_ids), text=text,
                              text_delta=delta, finish_reason=finish, logprobs=None, cum_logprob=None)
    return types.SimpleNamespace(outputs=[c])


@pytest.mark.parametrize("names", [None, ["output_ids", "text_output", "num_input_tokens", "num_output_tokens"],
                                   ["text_output", "context_ids", "finish_reason", "cum_log_probs"]])
@pytest.mark.parametrize("echo", [False, True])
def test_cached_responses_equal_the_contract_builder(names, echo):
    """Two streams of repeated tokens through one model's cache: each response's arrays equal
    response_arrays' for the same step, and each distinct small value was built once."""
    cache = TensorCache(FakePb.Tensor)
    metrics = types.SimpleNamespace(add_tokens=lambda *a: None, observe_token_times=lambda *a: None)
    engine = types.SimpleNamespace(abort=lambda rid: None)
    tokens = [7, 8, 7, 7, 9, 8, 7, 7]
    pieces = {7: " a", 8: "é", 9: "x" * 60}   # the last longer than MAX_TEXT_BYTES: built every time
    FakeTensor.built = 0
    for rep in range(2):
        req = FakeRequest(names)
        state = RequestState(FakePb, req, 1, cache)
        parsed = types.SimpleNamespace(stream=True, exclude_input_in_output=not echo, return_log_probs=False,
                                       prompt="hi", prompt_token_ids=None)
        row = RowStream(state, engine, metrics, None, 0, f"r{rep}", parsed, [1, 2, 3], 1, 0.0, lambda r: None)
        want = []
        for k, tok in enumerate(tokens):
            finish = "length" if k == len(tokens) - 1 else None
            first = k == 0
            text = ("hi" if echo and first else "") + pieces[tok]
            out_ids = ([1, 2, 3] if echo and first else []) + [tok]
            prev = ([1, 2, 3] if echo and not first else []) + tokens[:k]  # what went out before
            want.append(response_arrays(text=text, new_ids=out_ids, finish_reason=finish, cum_log_prob=None,
                                        log_probs=[], num_input_tokens=3, num_output_tokens=k + 1, batch_index=0,
                                        sequence_index=0, context_ids=prev[-8:], names=state.outputs))
            row.on_output(_output(0, tokens[:k + 1], [tok], "", pieces[tok], finish))
        assert len(req.sent) == len(tokens)
        assert req.sent[-1][1] == FakePb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and state.closed
        for (resp, _), arrays in zip(req.sent, want):
            got = {t.name: t.a for t in resp.tensors}
            assert set(got) == set(arrays) == (set(names) if names else {s.name for s in OUTPUTS} - {"logprobs_detail"})
            for name, a in arrays.items():
                _same(got[name], a)
    assert cache.hits > 0
    # the second stream built only what cannot be cached (60-byte text, context_ids of 3+ ids)
    assert FakeTensor.built < 2 * len(tokens) * len(want[0])
