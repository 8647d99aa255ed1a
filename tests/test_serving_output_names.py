"""The request parameter `output_names` through Triton's HTTP generate_stream against the real
tritonserver (serving.md: which outputs a generate request gets)."""
from __future__ import annotations

import pytest

from serving_utils import served_tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")
NAME = "tiny"


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """(engine_dir, tritonserver) for a tiny engine built and served the way a user does it."""
    with served_tiny_engine(tiny_checkpoint, tmp_path_factory.mktemp("outnames"), NAME) as pair:
        yield pair


def _generate_stream_events(url: str, body: dict) -> list:
    import http.client
    import json
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.netloc, timeout=120)
    try:
        conn.request("POST", u.path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read().decode("utf-8")
    finally:
        conn.close()
    if not raw.lstrip().startswith("data:"):
        return [json.loads(raw)]  # an error before any response: one JSON object
    return [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]


def test_generate_stream_output_names_parameter(served):
    """Triton's generate extension passes a body field that is not an input as a request
    parameter: `output_names` gives events that carry exactly those outputs (with the same tokens
    as a request without it, which carries every contract output), and a name outside the
    contract fails the request naming the parameter and the allowed names."""
    from tritium.backend.triton_backend.contract import OUTPUTS
    from tritium.client.bench.bench_triton_http import generate_stream_url
    _, srv = served
    url = generate_stream_url(srv.triton_http_url, NAME)
    base = {"text_input": "Passage: the river runs past the old mill", "max_tokens": 5, "stream": True,
            "temperature": 0.0, "sampling_parameters": '{"ignore_eos": true}'}
    full = _generate_stream_events(url, base)
    named = _generate_stream_events(url, dict(base, output_names="output_ids, num_output_tokens"))
    assert len(full) == len(named) == 5
    meta = {"model_name", "model_version", "id"}
    contract = {t.name for t in OUTPUTS}
    assert all(set(e) - meta <= contract for e in full) and "text_output" in full[0] and "context_ids" in full[0]
    assert all(set(e) - meta == {"output_ids", "num_output_tokens"} for e in named), named[0]
    assert [e["output_ids"] for e in named] == [e["output_ids"] for e in full]
    assert named[-1]["num_output_tokens"] == 5
    bad = _generate_stream_events(url, dict(base, output_names="output_ids,logits"))
    assert len(bad) == 1 and "output_names" in bad[0]["error"] and "text_output" in bad[0]["error"], bad
    ok = _generate_stream_events(url, dict(base, output_names="output_ids"))  # the server still serves
    assert [e["output_ids"] for e in ok] == [e["output_ids"] for e in full]
