"""Log probs of a long stream through the real tritonserver: each response carries its own
tokens' log probs (RowStream._emit takes only the new entries, not the whole sequence's on every
response), and they equal the non-streamed response's and the in-process engine's.

Oracle: the in-process LLMEngine's log prob entries (raw log-softmax of the model's logits) and
the same request without streaming, both over tritonclient (gRPC and HTTP)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from serving_utils import served_tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "tiny"
PROMPT = "Passage: the river runs past the old mill"
TOKENS = 40


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """(engine_dir, tritonserver) for a tiny engine built and served the way a user does it."""
    with served_tiny_engine(tiny_checkpoint, tmp_path_factory.mktemp("lpstream"), NAME) as pair:
        yield pair


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_streamed_log_probs_equal_non_streamed(served, protocol):
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    from tritium.client.triton_client import TritiumClient
    engine, srv = served
    ref = LLMEngine(engine).generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True,
                                                              logprobs=2))[0].outputs[0]
    want = [e["logprob"] for e in ref.logprobs]
    cl = TritiumClient(srv.grpc_url if protocol == "grpc" else srv.http_url, protocol=protocol, model=NAME)
    kw = dict(max_tokens=TOKENS, temperature=0.0, return_log_probs=True,
              sampling_parameters=json.dumps({"ignore_eos": True, "logprobs": 2}))
    chunks = list(cl.stream(PROMPT, **kw))
    whole = cl.generate(PROMPT, **kw)
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == whole.token_ids == list(ref.token_ids) and len(ids) == TOKENS
    for c in chunks:  # each response: exactly its own tokens' log probs and details
        assert len(c.log_probs) == len(c.token_ids) == len(c.logprobs_detail), c
        assert [d["id"] for d in c.logprobs_detail] == c.token_ids
        assert [d["logprob"] for d in c.logprobs_detail] == pytest.approx(c.log_probs, abs=1e-6)
        assert all(len(d["top"]) == 2 for d in c.logprobs_detail)
    streamed = [x for c in chunks for x in c.log_probs]
    # the same values streamed or not (a repeated prompt may come from the prefix cache: float32 last bits)
    assert streamed == pytest.approx(whole.log_probs, abs=1e-5)
    assert np.allclose(streamed, want, atol=1e-4)
    assert chunks[-1].cum_log_prob == pytest.approx(sum(want), abs=1e-3)
    assert whole.cum_log_prob == pytest.approx(chunks[-1].cum_log_prob, abs=1e-4)
