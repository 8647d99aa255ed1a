"""The README tour on the real default model, served: every route asked the same greedy question
twice gives the same answer, and it is "Paris" (issue 34: the OpenAI route used to answer
"L'Étoile, la Marseillaise, ..." once the prompt came from the prefix cache).

SmolLM2-135M-Instruct built bf16 with `tritium build --repo` and served by `tritium serve` (real
tritonserver, free ports); clients: `tritium generate --url` (tritonclient gRPC), a raw HTTP POST
as the README's curl sends, the official `openai` package, and TritiumClient.
"""
from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import re

import pytest

from serving_utils import tritium_serve

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def served(smollm2_gguf, tmp_path_factory):
    from tritium.client.cli.main import main
    root = str(tmp_path_factory.mktemp("tour"))
    engine, repo = os.path.join(root, "smollm2-bf16"), os.path.join(root, "repo")
    assert main(["build", smollm2_gguf, "-o", engine, "--dtype", "bfloat16", "--quiet", "--repo", repo,
                 "--name", "smollm2"]) == 0
    env = dict(os.environ, TRITIUM_CACHE=os.path.join(root, "cache"))
    with tritium_serve(repo, root, env=env) as (proc, lines):
        text = "".join(lines)
        yield {"grpc": re.search(r"gRPC (\S+)", text).group(1), "http": re.search(r"HTTP (\S+)", text).group(1),
               "openai": re.search(r"OpenAI API: (\S+)", text).group(1)}


def _generate_url(served) -> str:
    from tritium.client.cli.main import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["generate", "--url", served["grpc"], "--model", "smollm2", "--max-tokens", "48", "--json",
                     "--chat", QUESTION]) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1])["text"]


def _curl(served) -> str:
    host, port, path = re.match(r"http://([^:/]+):(\d+)(/\S*)", served["openai"]).groups()
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48,
            "temperature": 0}
    c.request("POST", path.rstrip("/") + "/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = json.loads(r.read())
    assert r.status == 200, data
    return data["choices"][0]["message"]["content"]


def _openai(served) -> str:
    import openai
    oa = openai.OpenAI(base_url=served["openai"], api_key="unused", max_retries=0, timeout=300)
    answer = oa.chat.completions.create(model="smollm2", temperature=0, max_tokens=48,
                                        messages=[{"role": "user", "content": QUESTION}])
    return answer.choices[0].message.content


def test_every_route_answers_paris_twice(native_cpu, served):
    from tritium.client.triton_client import TritiumClient
    chat = {}
    for route in (_generate_url, _curl, _openai):  # the README's order
        chat[route.__name__] = [route(served), route(served)]
    texts = {t for pair in chat.values() for t in pair}
    assert len(texts) == 1, chat  # one greedy answer, whatever the route and however often asked
    assert "Paris" in texts.pop()
    for protocol, url in (("grpc", served["grpc"]), ("http", served["http"])):
        c = TritiumClient(url, protocol=protocol, model="smollm2")
        first, second = (c.generate("The capital of France is", max_tokens=16, temperature=0).text for _ in range(2))
        assert first == second and "Paris" in first, (protocol, first, second)
