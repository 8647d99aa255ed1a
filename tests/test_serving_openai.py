"""The OpenAI-compatible API of a real `tritium serve` (tritonserver + the API on --openai-port),
driven by the official `openai` client (sync, async, streaming) and raw HTTP.

One server for the module, serving three tiny Llama engines: `tiny` (a ChatML chat template in its
tokenizer_config.json), `plain` (no template) and `tiny_q1` (the same engine with a waiting queue
of 1, for the 503). The oracle is `tritium generate --engine` in this process (the in-process
engine, greedy), never the server under test.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from serving_utils import metric, scrape, tritium_serve, wait_for

pytestmark = pytest.mark.slow

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QUESTION = "Which fox jumps over the lazy dog?"
MAX_POS = 4096  # long enough that a cancelled request is provably cut short
ADMIN_KEY = "admin-key-of-the-openai-tests"


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory):
    """(engine with template, engine without, repo) from the real `tritium build` command."""
    from tritium.builder.repository import llm_config
    from tritium.client.cli.main import main
    root = tmp_path_factory.mktemp("openai")
    ckpt = str(root / "ckpt")
    shutil.copytree(tiny_checkpoint("llama", max_position_embeddings=MAX_POS), ckpt)
    cfg_path = os.path.join(ckpt, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    plain_ckpt = str(root / "plain_ckpt")
    shutil.copytree(ckpt, plain_ckpt)
    cfg["chat_template"] = CHATML
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    engine, plain, repo = str(root / "engine"), str(root / "plain"), str(root / "repo")
    for src, out, name in ((ckpt, engine, "tiny"), (plain_ckpt, plain, "plain")):
        assert main(["build", src, "-o", out, "--dtype", "float32", "--max-batch-size", "16", "--quiet",
                     "--max-seq-len", str(MAX_POS),
                     "--repo", repo, "--name", name]) == 0
    # The same engine with room for one running and one waiting request: the third is refused (503).
    os.makedirs(os.path.join(repo, "tiny_q1", "1"))
    with open(os.path.join(repo, "tiny_q1", "config.pbtxt"), "w") as f:
        f.write(llm_config("tiny_q1", engine, 16, {"max_queue_size": "1", "max_num_seqs": "1"}))
    return engine, plain, repo, str(root)


class Served:
    def __init__(self, proc, lines):
        self.proc = proc
        text = "".join(lines)
        self.grpc = re.search(r"gRPC (\S+)", text).group(1)
        self.metrics_url = re.search(r"metrics (\S+)", text).group(1)
        self.base = re.search(r"OpenAI API: (\S+)", text).group(1)
        self.lines = lines


@pytest.fixture(scope="module")
def served(built):
    """`tritium serve --repo REPO` with every port free-picked (--openai-port 0), as a user starts it."""
    engine, plain, repo, root = built
    # the admin key, so that `tritium openai` alone (below) may list the models (docs/security.md)
    env = dict(os.environ, TRITIUM_CACHE=os.path.join(root, "cache"), TRITIUM_ADMIN_KEY=ADMIN_KEY)
    with tritium_serve(repo, root, env=env) as (proc, lines):
        yield Served(proc, lines)


@pytest.fixture(scope="module")
def client(served):
    import openai
    return openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine_generate(built):
    """`tritium generate --engine E --json ...` in this process -> its JSON results (the oracle)."""
    import contextlib
    import io
    from tritium.client.cli.main import main
    cache = {}

    def run(*args):
        key = args
        if key not in cache:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(["generate", "--engine", built[0], "--json", *args]) == 0
            cache[key] = [json.loads(ln) for ln in buf.getvalue().splitlines() if ln.startswith("{")]
        return cache[key]
    return run


def _conn(served, timeout=60):
    host, port = re.match(r"http://([^:/]+):(\d+)", served.base).groups()
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def _post(served, path, body, timeout=60):
    """Raw POST (bytes or JSON-able body) -> (status, response); the caller reads and closes."""
    c = _conn(served, timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    c.request("POST", "/v1" + path, body=data, headers={"Content-Type": "application/json"})
    return c, c.getresponse()


def _stats(served, model="tiny"):
    text = scrape(served)
    return {"used": metric(text, "tritium_kv_cache_blocks", model=model, state="used"),
            "running": metric(text, "tritium_requests", model=model, state="running"),
            "generated": metric(text, "tritium_generation_tokens_total", model=model)}


# ---- models, errors ------------------------------------------------------------------------------
def test_models_lists_the_llm_models_only(client):
    ids = sorted(m.id for m in client.models.list())
    assert ids == ["plain", "tiny", "tiny_q1"]  # not the _ensemble / _bls / _pre / _postprocessing wrappers
    assert client.models.retrieve("tiny").id == "tiny"


def test_unknown_model_is_404(client):
    import openai
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404
    assert e.value.body["param"] == "model" and "nope" in e.value.body["message"]


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=5.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(max_tokens=MAX_POS * 2), "max_tokens"),          # found by the backend (depends on the prompt)
    (dict(max_completion_tokens=MAX_POS * 2), "max_completion_tokens"),
    (dict(logit_bias={"999999": 1}), "logit_bias"),        # outside the vocabulary: the backend's check
    (dict(logit_bias={"5": 500}), "logit_bias"),
    (dict(top_logprobs=3), "top_logprobs"),                # without logprobs: true
    (dict(seed=-1), "seed"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
     "tools[0].function.parameters"),
])
def test_bad_parameter_is_400_naming_it(client, kwargs, param):
    import openai
    args = dict(model="tiny", messages=[{"role": "user", "content": "hi"}])
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert "Traceback" not in e.value.body["message"]


def test_streamed_request_with_a_bad_parameter_is_still_a_plain_400(client):
    """The backend's checks come before the first token, so the 400 goes out before any event."""
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=MAX_POS * 2, stream=True)
    assert e.value.body["param"] == "max_tokens"


def test_chat_without_template_is_a_clear_400_and_completions_still_work(client):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert "no chat template" in e.value.body["message"] and e.value.body["param"] == "messages"
    c = client.completions.create(model="plain", prompt="The quick", max_tokens=4, temperature=0)
    assert c.usage.completion_tokens == 4 and c.choices[0].finish_reason == "length"


def test_raw_http_errors_have_the_openai_shape(served):
    cases = [("/chat/completions", b"{not json", 400), ("/completions", ["a list"], 400),
             ("/completions", {"model": "tiny"}, 400), ("/no/such/route", {}, 404)]
    for path, body, status in cases:
        c, r = _post(served, path, body)
        assert r.status == status, (path, r.status)
        err = json.loads(r.read())["error"]
        c.close()
        assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]


# ---- answers against the oracle ------------------------------------------------------------------
def test_greedy_chat_and_templated_completion_equal_generate_engine(client, built, engine_generate):
    """chat(QUESTION) == completions(templated prompt) == `tritium generate --engine E --chat QUESTION`,
    and usage counts equal the engine's token counts."""
    from tritium.backend.chat_template import ChatTemplate
    ref = engine_generate("--chat", "--max-tokens", "24", QUESTION)[0]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == ref["text"]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == ref["finish_reason"]
    assert chat.usage.prompt_tokens == len(ref["prompt_token_ids"])
    assert chat.usage.completion_tokens == len(ref["token_ids"])
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    prompt = ChatTemplate.from_engine_dir(built[0]).render([{"role": "user", "content": QUESTION}])
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    comp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    assert comp.choices[0].text == ref["text"]
    assert comp.usage.prompt_tokens == len(ref["prompt_token_ids"])


def test_streamed_chat_deltas_join_to_the_message(client):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_ends_with_done(served):
    body = {"model": "tiny", "prompt": "The quick brown", "max_tokens": 5, "stream": True, "temperature": 0}
    c, r = _post(served, "/completions", body)
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    events = [ln.decode().strip() for ln in r.read().splitlines() if ln.strip()]
    c.close()
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all(p["object"] == "text_completion" for p in payloads)


def test_n2_async_gives_two_choices(served):
    import openai

    async def go():
        c = openai.AsyncOpenAI(base_url=served.base, api_key="unused", max_retries=0)
        try:
            whole = await c.completions.create(model="tiny", prompt="Paged attention", max_tokens=8, n=2,
                                               temperature=1.0, seed=7)
            streamed = await c.chat.completions.create(model="tiny", n=2, max_tokens=6, temperature=1.0, seed=7,
                                                       messages=[{"role": "user", "content": QUESTION}], stream=True)
            texts = {0: "", 1: ""}
            async for ch in streamed:
                for choice in ch.choices:
                    texts[choice.index] += choice.delta.content or ""
            return whole, texts
        finally:
            await c.close()
    whole, texts = asyncio.run(go())
    assert [ch.index for ch in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 16  # 2 x 8 (the tiny model hardly ever ends early)
    assert set(texts) == {0, 1} and all(texts.values())


def test_sampling_parameters_reach_the_engine(client, built):
    """The server's text equals the in-process engine's with the same SamplingParams: seeded
    sampling with top_p (a seeded sequence depends only on its seed and history), and greedy
    decoding with presence / frequency penalties."""
    from tritium.backend.engine import LLMEngine
    from tritium.backend.sampling_params import SamplingParams
    eng = LLMEngine(built[0])

    def ref(**k):
        return eng.generate(["The quick brown fox"], SamplingParams(max_tokens=32, **k))[0].outputs[0].text

    def got(**k):
        return client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=32, **k).choices[0].text
    sampled = dict(temperature=0.9, top_p=0.8, seed=123)
    assert got(**sampled) == ref(**sampled)
    penalized = dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=1.0)
    assert ref(**penalized) != ref(temperature=0.0)  # they matter here: a server dropping them would fail
    assert got(**penalized) == ref(**penalized)


def test_two_prompts_and_seed_reproducible(client):
    a = client.completions.create(model="tiny", prompt=["The quick", "Paged"], max_tokens=6, temperature=1.0, seed=11)
    b = client.completions.create(model="tiny", prompt=["The quick", "Paged"], max_tokens=6, temperature=1.0, seed=11)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_stop_and_finish_reasons(client, engine_generate):
    ref = engine_generate("--max-tokens", "24", "The quick brown fox")[0]["text"]
    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    assume = ref.index(stop)  # the first occurrence: where generation must end
    c = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0, stop=[stop])
    assert c.choices[0].text == ref[:assume] and c.choices[0].finish_reason == "stop"
    c = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=3, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 3


def test_logprobs_match_the_engine(client, engine_generate):
    ref = engine_generate("--max-tokens", "6", "--logprobs", "3", "The quick brown fox")[0]
    c = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text == ref["text"]
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in ref["logprobs"]], abs=1e-4)
    for top, e in zip(lp.top_logprobs, ref["logprobs"]):  # {token text: logprob}: equal texts merge
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(e["top_logprobs"][0]["logprob"], abs=1e-4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-6) for t in content)


def test_logit_bias_bans_and_forces_tokens(client, built, engine_generate):
    from tokenizers import Tokenizer
    ref = engine_generate("--max-tokens", "4", "The quick brown fox")[0]
    first = ref["token_ids"][0]
    banned = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0,
                                       logit_bias={str(first): -100})
    assert not banned.choices[0].text.startswith(ref["text"][:1]) or banned.choices[0].text != ref["text"]
    forced = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0,
                                       logit_bias={"300": 100})
    tok = Tokenizer.from_file(os.path.join(built[0], "tokenizer.json"))  # the engine's own tokenizer file
    assert forced.choices[0].text == tok.decode([300] * 4)
    plain = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=4, temperature=0)
    assert plain.choices[0].text == ref["text"]  # the bias applied to its own request only


def test_generate_url_chat_equals_generate_engine_chat(served, engine_generate, capsys):
    from tritium.client.cli.main import main
    ref = engine_generate("--chat", "--max-tokens", "12", QUESTION)[0]
    capsys.readouterr()
    assert main(["generate", "--url", served.grpc, "--model", "tiny", "--chat", "--max-tokens", "12", "--json",
                 QUESTION]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["text"] == ref["text"] and got["num_input_tokens"] == len(ref["prompt_token_ids"])


# ---- cancellation and overload -----------------------------------------------------------------
def test_client_disconnect_cancels_and_frees_kv_blocks(served, built):
    # 16 samples of ~4000 tokens, EOS banned so none ends early: many seconds of work for the tiny
    # engine (one greedy sample alone takes ~1 s).
    with open(os.path.join(built[0], "engine.json")) as f:
        eos = json.load(f)["model"]["eos_token_ids"]
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": MAX_POS - 64, "temperature": 1.0, "n": 16,
            "logit_bias": {str(t): -100 for t in eos}}
    full = body["n"] * body["max_tokens"]
    # streamed: read a few events, then close the connection
    before = _stats(served)["generated"]
    c, r = _post(served, "/completions", dict(body, stream=True))
    assert r.status == 200
    for _ in range(8):
        assert r.readline()
    assert wait_for(lambda: _stats(served)["running"] >= 1, 10), "the request is not running"
    r.close()
    c.close()
    assert wait_for(lambda: _stats(served)["running"] == 0 and _stats(served)["used"] == 0, 30), _stats(served)
    time.sleep(0.3)
    streamed = _stats(served)["generated"] - before
    # non-streamed: the client gives up (timeout) while the answer is generated, and hangs up
    before = _stats(served)["generated"]
    c = _conn(served, timeout=1.5)
    c.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert wait_for(lambda: _stats(served)["running"] >= 1, 10), "the request is not running"
    with pytest.raises(TimeoutError):
        c.getresponse()
    c.close()
    assert wait_for(lambda: _stats(served)["running"] == 0 and _stats(served)["used"] == 0, 30), _stats(served)
    time.sleep(0.3)
    joined = _stats(served)["generated"] - before
    # Both were cut short: far fewer tokens than the full answers.
    assert 0 < streamed < full / 2 and 0 < joined < full / 2, (streamed, joined, full)


def test_overloaded_is_503(served):
    body = {"model": "tiny_q1", "prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0}
    results = []

    def send():
        c, r = _post(served, "/completions", body, timeout=300)
        results.append((r.status, json.loads(r.read()), r.getheader("Retry-After")))
        c.close()
    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(code for code, _, _ in results)
    assert codes.count(200) >= 2 and 503 in codes, codes
    err, retry = next((d, h) for code, d, h in results if code == 503)
    assert err["error"]["code"] == "overloaded" and "Traceback" not in err["error"]["message"] and retry == "1"


# ---- `tritium openai` alone --------------------------------------------------------------------
def _openai_alone(triton_url):
    proc = subprocess.Popen([sys.executable, "-m", "tritium.client.cli", "openai", "--triton-url", triton_url,
                             "--port", "0", "--admin-key", ADMIN_KEY], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    m = re.search(r"OpenAI API: (\S+)", line)
    if not m:
        proc.kill()
        raise AssertionError(f"tritium openai printed {line!r}")
    return proc, m.group(1)


def test_tritium_openai_alone_in_front_of_a_running_tritonserver(served, client):
    import openai
    proc, base = _openai_alone(served.grpc)
    try:
        alone = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        assert sorted(m.id for m in alone.models.list()) == ["plain", "tiny", "tiny_q1"]
        args = dict(model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=8, temperature=0)
        assert alone.chat.completions.create(**args).choices[0].message.content == \
            client.chat.completions.create(**args).choices[0].message.content
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_unreachable_tritonserver_is_503():
    import openai
    proc, base = _openai_alone("127.0.0.1:1")
    try:
        alone = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as e:
            alone.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and "cannot reach tritonserver" in e.value.body["message"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
