"""The benchmark and `tritium generate --protocol http` against the real tritonserver started with
an API key (`tritium serve --api-key`, docs/security.md): `tritium bench` sends the key on HTTP,
gRPC and to the OpenAI API (flag and $TRITIUM_API_KEY) and works; without it, or with a wrong
one, it fails at the start with one line naming the flag. `tritium generate --protocol http` and
the benchmark's HTTP driver name the outputs they read (the request parameter `output_names`),
except to an ensemble, and read what they read before."""
from __future__ import annotations

import json

import pytest

from tritium.client.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
NAME = "tiny"
KEY = "bench-key-0123456789abcdef"
SMALL = ["--num-requests", "3", "--prompt-words", "4", "10", "--output-len", "2", "4", "--seed", "1",
         "--warmup", "1", "--no-progress", "--single-stream", "1", "--single-stream-words", "5",
         "--single-stream-tokens", "3", "--concurrency", "2", "--bandwidth-mb", "8", "--json"]


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """A tiny engine served with an API key, the way `tritium serve --api-key` starts tritonserver,
    and the OpenAI API in this process in front of it (sharing the key)."""
    from tritium.client.openai.openai_server import OpenAIServer
    from tritium.client.security import Security
    from tritium.client.serve.server import TritonServer
    root = tmp_path_factory.mktemp("keyed")
    engine, repo = str(root / "engine"), str(root / "repo")
    assert main(["build", tiny_checkpoint("llama"), "-o", engine, "--dtype", "float32", "--quiet",
                 "--repo", repo, "--name", NAME]) == 0
    srv = TritonServer(repo, log_file=str(root / "server.log"), security=Security(api_key=KEY))  # every model
    srv.start(timeout=240)
    api = None
    try:
        api = OpenAIServer(srv.grpc_url, port=0, security=srv.security).start()
        srv.openai_url = f"http://127.0.0.1:{api.port}"
        yield srv
    finally:
        if api is not None:
            api.stop()
        assert srv.stop() == 0


def _bench(capsys, *argv):
    rc = main(["bench", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bench_sends_the_key_and_fails_clearly_without_it(served, capsys, monkeypatch, protocol):
    url = served.http_url if protocol == "http" else served.grpc_url
    base = ["--url", url, "--model", NAME, "--triton-protocol", protocol, *SMALL]
    rc, out, err = _bench(capsys, *base, "--api-key", KEY)
    assert rc == 0, err
    res = json.loads(out)
    for s in res["runs"][f"tritium-{protocol}"]:
        assert s["errors"] == 0 and s["output_tokens"] == s["requested_tokens"] > 0
    monkeypatch.setenv("TRITIUM_API_KEY", KEY)  # the variable tritium serve reads works too
    rc, _, err = _bench(capsys, *base)
    assert rc == 0, err
    monkeypatch.delenv("TRITIUM_API_KEY")
    for extra in ([], ["--api-key", "w" * 24]):  # no key, a wrong key
        rc, out, err = _bench(capsys, *base, *extra)
        lines = err.strip().splitlines()
        assert rc == 2 and out == "" and len(lines) == 1 and "--api-key" in lines[0] and "refused" in lines[0], err
        assert "Traceback" not in err
    rc, _, err = _bench(capsys, *base, "--api-key", "short")
    assert rc == 2 and "--api-key" in err and "16 characters" in err


def test_bench_openai_url_sends_the_key(served, capsys):
    base = ["--openai-url", served.openai_url, "--openai-model", NAME, *SMALL]
    rc, out, err = _bench(capsys, *base, "--api-key", KEY)
    assert rc == 0, err
    for s in json.loads(out)["runs"]["openai"]:
        assert s["errors"] == 0 and s["output_tokens"] == s["requested_tokens"] > 0
    rc, out, err = _bench(capsys, *base)
    assert rc == 2 and "--openai-url" in err and "--api-key" in err and len(err.strip().splitlines()) == 1, err


def test_generate_http_names_its_outputs_and_prints_the_same(served, capsys, monkeypatch):
    """`tritium generate --protocol http` sends `output_names` (the outputs a Chunk reads): its
    events carry exactly those, and what it prints equals the output without the parameter (every
    contract output in each event) and over gRPC, streamed or not."""
    from tritium.client import triton_client
    seen = []
    real = triton_client._chunk_from_json

    def spy(d):
        seen.append(set(d) - {"model_name", "model_version", "id"})
        return real(d)
    monkeypatch.setattr(triton_client, "_chunk_from_json", spy)

    def gen(*extra, protocol="http"):
        url = served.http_url if protocol == "http" else served.grpc_url
        rc = main(["generate", "--url", url, "--model", NAME, "--protocol", protocol, "--api-key", KEY,
                   "--max-tokens", "6", "--temperature", "0", *extra, "Passage: the river runs past the mill"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        return out.out
    named = {m: gen(*m) for m in ((), ("--stream",), ("--json",))}
    assert seen and all(keys == set(triton_client.READ_OUTPUTS) for keys in seen), seen[:2]
    monkeypatch.setattr(triton_client, "http_body", lambda req: req)  # as before: no output_names
    seen.clear()
    before = {m: gen(*m) for m in ((), ("--stream",), ("--json",))}
    assert any("context_ids" in keys for keys in seen)  # the old events carried every output
    assert named == before
    assert named[()] == gen(protocol="grpc") and json.loads(named[("--json",)])["num_output_tokens"] == 6


def test_http_driver_names_outputs_except_to_an_ensemble(served):
    """The ensemble hands request parameters to its steps, so `output_names` would starve its
    postprocessing (whose stream-safe text needs the LLM step's other outputs): the driver names
    outputs to NAME and NAME_bls only, and every model gives the same tokens and text."""
    from tritium.client.bench.bench_triton_http import TritonHttpDriver
    from tritium.client.bench.bench_workload import BenchRequest
    got = {}
    for model in (NAME, f"{NAME}_ensemble", f"{NAME}_bls"):
        drv = TritonHttpDriver(served.http_url, model, keep_token_ids=True, api_key=KEY)
        drv.check()
        assert drv.name_outputs == (model != f"{NAME}_ensemble")
        assert ("output_names" in drv.body(BenchRequest(0, "x", 1, 3), "r")) == drv.name_outputs
        session = drv.session()
        try:
            res = [session.run(BenchRequest(i, f"Passage e.{i}: the river runs past the mill", 9, 12), f"e-{model}-{i}")
                   for i in range(2)]
        finally:
            session.close()
        assert all(r.ok and r.num_output_tokens == 12 for r in res), [r.error for r in res]
        got[model] = [(r.token_ids, r.text_chars) for r in res]
    assert got[NAME] == got[f"{NAME}_ensemble"] == got[f"{NAME}_bls"]
