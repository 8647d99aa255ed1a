"""Decode bursts (backend/decode_burst.py, kernels/cpu_decode_burst.c): several greedy decode steps
in one native call must give what the same steps one by one give: the same token ids, text,
finish and stop reasons, engine counters and prefix-cache hits, every KV block freed after, on
bf16, int8 (W8A8) and int4 (W4A8) tiny engines, a sliding window, and every forced native path.

Oracles: the same engine with bursts off (max_decode_burst=1: one native step per engine step,
itself tested bit for bit against the per-op path in test_native_step.py), and Hugging Face
transformers' greedy generate for a float32-exact check of the tokens a burst produces.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from tritium.backend import decode_burst
from tritium.backend.engine import LLMEngine
from tritium.backend.engine_options import engine_setup, options_from_params
from tritium.backend.native_decode import NativeDecode
from tritium.backend.sampling_params import SamplingParams
from tritium.builder.build import BuildOptions, build_engine

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, tmp_path_factory):
    """Block size 4 (bursts of 8 cross blocks): bf16 Llama, its int8 (W8A8) build, an int4 (W4A8)
    build with tied embeddings (as SmolLM2: the lookup reads the int6 head's panels; an untied int6
    embedding's packed rows are not the burst's), and a bf16 Mistral with a sliding window of 7."""
    out = {}
    for name, family, over, kw in (
            ("bf16", "llama", SMALL, dict(dtype="bfloat16", deterministic=True)),
            ("int8", "llama", SMALL, dict(dtype="bfloat16", quantization="int8")),
            ("int4", "llama", dict(SMALL, tie_word_embeddings=True), dict(dtype="bfloat16", quantization="int4-rtn")),
            ("bf16-window", "mistral", dict(SMALL, sliding_window=7), dict(dtype="bfloat16", deterministic=True))):
        path = str(tmp_path_factory.mktemp(f"burst-{name}") / "engine")
        build_engine(BuildOptions(source=tiny_checkpoint(family, **over), output=path, progress=False,
                                  block_size=4, **kw))
        out[name] = path
    return out


@pytest.fixture
def bursts(monkeypatch):
    """Records (rows, k asked, steps run) of every burst the runner ran."""
    seen = []
    real = NativeDecode.run_burst

    def counted(self, sched, k, stop_ids):
        out = real(self, sched, k, stop_ids)
        seen.append((len(sched.seqs), k, None if out is None else len(out)))
        return out
    monkeypatch.setattr(NativeDecode, "run_burst", counted)
    monkeypatch.delenv(decode_burst.ENV, raising=False)
    return seen


def _run(path, reqs, burst, blocks=64, prefix=True, order=None):
    """Every request added at once (then each later group once the earlier finished: `order`, a
    list of index lists); returns ({index: final CompletionOutput}, engine counters, outputs per
    request, the engine)."""
    eng = LLMEngine(path, num_kv_blocks=blocks, enable_prefix_caching=prefix, max_decode_burst=burst)
    final, num_outputs = {}, {}
    for group in order or [range(len(reqs))]:
        for i in group:
            eng.add_request(str(i), prompt_token_ids=reqs[i][0], params=reqs[i][1])
        while eng.has_unfinished():
            for out in eng.step():
                num_outputs[int(out.request_id)] = num_outputs.get(int(out.request_id), 0) + 1
                if out.finished:
                    final[int(out.request_id)] = (out.outputs[0], out.metrics)
    used, _, _ = eng.block_manager.usage()
    assert used == 0, f"KV blocks leaked: {used} still in use"
    counters = (eng.num_steps, eng.num_computed_tokens, eng.num_generated_tokens)
    return final, counters, num_outputs, eng


def _same(a, b):
    for i in b:
        (ca, ma), (cb, mb) = a[i], b[i]
        assert ca.token_ids == cb.token_ids, i
        assert (ca.text, ca.finish_reason, ca.stop_reason) == (cb.text, cb.finish_reason, cb.stop_reason), i
        assert ma["num_output_tokens"] == mb["num_output_tokens"] and ma["num_cached_tokens"] == mb["num_cached_tokens"]
        assert ma["num_scheduled_tokens"] == mb["num_scheduled_tokens"], i


def _greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "bf16-window"])
def test_burst_equals_steps(engines, name, native_bf16, bursts):
    """Rows of different lengths; max_tokens not multiples of 8 (the last burst is shorter);
    block boundaries crossed inside bursts (block size 4)."""
    rng = random.Random(len(name))
    reqs = [([rng.randrange(3, 200) for _ in range(n)], _greedy(m, ignore_eos=True))
            for n, m in ((1, 21), (5, 13), (11, 30), (3, 9))]
    off, c_off, n_off, _ = _run(engines[name], reqs, 1)
    assert not bursts
    on, c_on, n_on, _ = _run(engines[name], reqs, 8)
    _same(on, off)
    assert c_on == c_off  # steps, computed and generated tokens counted as if one by one
    ran = [b for b in bursts if b[2] is not None]
    assert ran and all(b[2] == b[1] for b in ran), bursts  # no stop ids: every burst ran its k steps
    assert any(b[0] == 4 for b in ran) and any(b[0] == 1 for b in ran)  # batches of 4 rows and a single stream
    assert sum(n_on.values()) < sum(n_off.values())  # one output per request per burst


@pytest.mark.parametrize("name", ["int8", "bf16-window"])
def test_kv_cache_bits_equal_steps(engines, name, native_bf16, bursts, monkeypatch):
    """Every key and value a burst wrote is the bits the steps one by one write: each request's
    cached positions, read through its own block table as it finished."""
    from tritium.backend.scheduler import Scheduler
    tables = {}
    real = Scheduler.finish

    def finish(self, seq, reason):
        tables[seq.request.request_id] = (list(seq.block_table), seq.num_computed_tokens)
        real(self, seq, reason)
    monkeypatch.setattr(Scheduler, "finish", finish)
    reqs = [([3, 4, 5, 6, 7], _greedy(19, ignore_eos=True)), ([9], _greedy(26, ignore_eos=True)),
            ([11, 12], _greedy(11, ignore_eos=True))]
    kv = []
    for burst in (1, 8):
        tables.clear()
        _, _, _, eng = _run(engines[name], reqs, burst)
        per_request = {}
        for rid, (table, n) in tables.items():
            rows = []
            for k_cache, v_cache in eng.runner.kv_caches:
                bs = k_cache.shape[1]
                idx = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
                rows.append((k_cache.flatten(0, 1)[idx], v_cache.flatten(0, 1)[idx]))
            per_request[rid] = rows
        kv.append(per_request)
    assert any(b[2] == 8 for b in bursts)
    assert kv[0].keys() == kv[1].keys() and len(kv[0]) == 3
    for rid in kv[0]:
        for (k0, v0), (k1, v1) in zip(kv[0][rid], kv[1][rid]):
            assert torch.equal(k0.view(torch.int16), k1.view(torch.int16)), rid
            assert torch.equal(v0.view(torch.int16), v1.view(torch.int16)), rid


def test_no_burst_above_max_rows(engines, native_bf16, bursts):
    """Five rows (decode_burst.MAX_BURST_ROWS is 4) that finish together: never a burst."""
    assert decode_burst.MAX_BURST_ROWS == 4
    reqs = [([5 + i, 6, 7], _greedy(10, ignore_eos=True)) for i in range(5)]
    off, c_off, _, _ = _run(engines["bf16"], reqs, 1)
    on, c_on, _, _ = _run(engines["bf16"], reqs, 8)
    _same(on, off)
    assert c_on == c_off and not bursts


def test_stop_token_mid_burst(engines, native_bf16, bursts):
    """A row whose stop id comes mid-burst ends the burst after that step; its neighbour goes on."""
    prompt = [7, 100, 42, 9]
    free, _, _, _ = _run(engines["int8"], [(prompt, _greedy(24, ignore_eos=True))], 1)
    ids = free[0][0].token_ids
    stop = next(t for j, t in enumerate(ids) if j >= 5 and t not in ids[:j])  # first seen at output j >= 5
    reqs = [(prompt, _greedy(24, ignore_eos=True, stop_token_ids=[stop])), ([3, 4, 5], _greedy(27, ignore_eos=True))]
    off, c_off, _, _ = _run(engines["int8"], reqs, 1)
    bursts.clear()
    on, c_on, _, _ = _run(engines["int8"], reqs, 8)
    _same(on, off)
    assert c_on == c_off
    assert on[0][0].finish_reason == "stop" and on[0][0].stop_reason == stop
    assert any(b[2] is not None and b[2] < b[1] for b in bursts), bursts  # a burst cut short by the stop id


def test_stop_string_mid_burst(engines, native_bf16, bursts):
    """A stop string completes inside a burst: the row drops its later tokens and its text ends
    before the stop string, as step by step; the other row goes on."""
    prompt = [100, 200, 300]
    free, _, _, _ = _run(engines["bf16"], [(prompt, _greedy(30, ignore_eos=True))], 1)
    text = free[0][0].text
    assert len(text) > 12, text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    reqs = [(prompt, _greedy(30, ignore_eos=True, stop=[stop])), ([5, 6], _greedy(30, ignore_eos=True))]
    off, c_off, _, _ = _run(engines["bf16"], reqs, 1)
    assert off[0][0].finish_reason == "stop" and off[0][0].stop_reason == stop
    assert len(off[0][0].token_ids) < 30
    on, c_on, _, _ = _run(engines["bf16"], reqs, 8)
    _same(on, off)
    assert c_on == c_off
    assert any(b[2] for b in bursts)


def test_min_tokens_ban_then_bursts(engines, native_bf16, bursts):
    """A row with min_tokens: no burst while its ban on stop ids is pending, bursts after; its stop
    id, banned early, ends it later exactly as step by step."""
    prompt = [7, 100, 42, 9]
    free, _, _, _ = _run(engines["int8"], [(prompt, _greedy(24, ignore_eos=True))], 1)
    ids = free[0][0].token_ids
    stop = ids[1]  # would end the row at its second token without the ban
    reqs = [(prompt, _greedy(24, ignore_eos=True, stop_token_ids=[stop], min_tokens=9))]
    off, c_off, _, _ = _run(engines["int8"], reqs, 1)
    on, c_on, _, _ = _run(engines["int8"], reqs, 4)
    _same(on, off)
    assert c_on == c_off
    assert len(on[0][0].token_ids) >= 9
    assert bursts and all(b[1] <= 4 for b in bursts)


def test_prefix_cache_after_bursts(engines, native_bf16, bursts):
    """Blocks filled by bursts are cached under the hashes of the tokens appended: a later request
    whose prompt is an earlier one's prompt and output gets the same hits and tokens."""
    first = ([9, 8, 7], _greedy(22, ignore_eos=True))
    off, _, _, _ = _run(engines["bf16"], [first], 1)
    follow = (first[0] + off[0][0].token_ids, _greedy(10, ignore_eos=True))
    reqs = [first, follow]
    off, c_off, _, _ = _run(engines["bf16"], reqs, 1, order=[[0], [1]])
    on, c_on, _, _ = _run(engines["bf16"], reqs, 8, order=[[0], [1]])
    _same(on, off)
    assert c_on == c_off
    assert on[1][1]["num_cached_tokens"] == 24  # (3 + 22 - 1) // 4 full blocks of 4 reused


def test_ineligible_rows_mixed_in(engines, native_bf16, bursts):
    """A sampled row or a log-probs row in the batch: no burst while it runs, same output."""
    reqs = [([5, 6, 7], _greedy(12, ignore_eos=True)),
            ([8, 9], SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)),
            ([10, 11, 12, 13], _greedy(12, ignore_eos=True, logprobs=2))]
    off, c_off, _, _ = _run(engines["int8"], reqs, 1)
    on, c_on, _, _ = _run(engines["int8"], reqs, 8)
    _same(on, off)
    assert on[2][0].logprobs == off[2][0].logprobs
    assert c_on == c_off
    assert not bursts  # the three finish together: never a step of greedy rows only


def test_no_burst_while_requests_wait_or_blocks_short(engines, native_bf16, bursts):
    """Nothing waits behind a burst (max_num_seqs 1 keeps the second request waiting while the
    first runs: only the second, alone, bursts), and a burst whose KV blocks do not fit is not
    taken; the output is the same."""
    reqs = [([5, 6, 7], _greedy(12, ignore_eos=True)), ([8, 9], _greedy(9, ignore_eos=True))]
    off, _, _, _ = _run(engines["bf16"], reqs, 1)
    eng = LLMEngine(engines["bf16"], num_kv_blocks=64, max_num_seqs=1, max_decode_burst=8)
    res = eng.generate(prompt_token_ids=[r[0] for r in reqs], params=[r[1] for r in reqs])
    assert [r.outputs[0].token_ids for r in res] == [off[0][0].token_ids, off[1][0].token_ids]
    ran = [b for b in bursts if b[2] is not None]
    assert ran and sum(b[2] for b in ran) == 9 - 1  # the second request's decode steps, none of the first's
    bursts.clear()
    # 3 + 12 tokens fill exactly 4 blocks of 4; with 5 blocks a burst of 8 past the 4th block's
    # start fits, with 4 only what the held blocks cover: each burst asks for no more than exists
    for blocks in (4, 5):
        tight, _, _, _ = _run(engines["bf16"], [reqs[0]], 8, blocks=blocks)
        assert tight[0][0].token_ids == off[0][0].token_ids


def test_env_overrides_and_bad_values(engines, native_bf16, bursts, monkeypatch):
    reqs = [([5, 6, 7], _greedy(12, ignore_eos=True))]
    monkeypatch.setenv(decode_burst.ENV, "1")
    _run(engines["bf16"], reqs, 8)
    assert not bursts
    monkeypatch.setenv(decode_burst.ENV, "4")
    _run(engines["bf16"], reqs, 1)
    assert bursts and max(b[1] for b in bursts) == 4
    monkeypatch.setenv(decode_burst.ENV, "zero")
    eng = LLMEngine(engines["bf16"], num_kv_blocks=16)
    eng.add_request("a", prompt_token_ids=[5, 6], params=_greedy(4))
    with pytest.raises(ValueError, match="TRITIUM_DECODE_BURST must be an integer in \\[1, 256\\]"):
        while eng.has_unfinished():
            eng.step()
    monkeypatch.delenv(decode_burst.ENV)
    with pytest.raises(ValueError, match="max_decode_burst must be an integer in \\[1, 256\\]"):
        LLMEngine(engines["bf16"], num_kv_blocks=16, max_decode_burst=0)
    with pytest.raises(ValueError, match="parameter max_decode_burst must be an integer in \\[1, 256\\]"):
        options_from_params({"max_decode_burst": "300"})
    assert engine_setup(options_from_params({"max_decode_burst": "3"})).engine_kwargs["max_decode_burst"] == 3


def test_two_threads(engines, bursts):
    """The step's parallel region (and its split head) on two threads: the same tokens."""
    reqs = [([5, 6, 7], _greedy(17, ignore_eos=True)), ([1, 2], _greedy(14, ignore_eos=True))]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        off, _, _, _ = _run(engines["int8"], reqs, 1)
        on, _, _, _ = _run(engines["int8"], reqs, 8)
    finally:
        torch.set_num_threads(n)
    _same(on, off)
    assert any(b[2] for b in bursts)


def test_burst_tokens_match_hf(tiny_checkpoint, engines, bursts):
    """The bf16 Llama's burst tokens against transformers' float32 model of the same checkpoint
    (teacher-forced on the burst's own output): each token is the reference's argmax, or within
    bf16's tolerance of it where the reference's top two are that close (3 % of the row's logit
    range: test_engine_numerics.py's bf16 bound), and at least 90 % are the argmax itself."""
    from hf_oracle import hf_model
    ref_model = hf_model(tiny_checkpoint("llama", **SMALL))
    prompts = [[5, 17, 923, 44, 300, 2, 81], [1, 600, 601, 602], [999]]
    on, _, _, _ = _run(engines["bf16"], [(p, _greedy(24, ignore_eos=True)) for p in prompts], 8)
    exact = total = 0
    for i, ids in enumerate(prompts):
        out = on[i][0].token_ids
        with torch.no_grad():
            ref = ref_model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
        for j, tok in enumerate(out):
            row = ref[j]
            top = int(row.argmax())
            exact += tok == top
            total += 1
            assert tok == top or row[top] - row[tok] <= 0.03 * (row.max() - row.min()), (ids, j, tok, top)
    assert exact >= 0.9 * total, (exact, total)
    assert any(b[2] == 8 for b in bursts)


def test_serve_flag_range(capsys, monkeypatch):
    """`tritium serve --max-decode-burst 300` fails before anything starts, naming the flag."""
    from tritium.client.cli.main import main
    monkeypatch.delenv(decode_burst.ENV, raising=False)
    assert main(["serve", "--max-decode-burst", "300", "--repo", "/nonexistent-repo"]) == 2
    assert "--max-decode-burst must be an integer in [1, 256] (1: off), got 300" in capsys.readouterr().err
    assert decode_burst.ENV not in os.environ
