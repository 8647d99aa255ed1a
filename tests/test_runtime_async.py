"""AsyncLLMEngine: concurrent streams from threads equal the sync engine; a dropped stream aborts
and frees its blocks; bad input raises in the caller's thread; shutdown ends the loop."""
import threading

import pytest

from tritium.backend.async_engine import AsyncLLMEngine
from tritium.backend.engine import LLMEngine
from tritium.backend.sampling_params import SamplingParams


# Tiny models: intra-op threads only add barrier waits (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def test_concurrent_streams_match_sync(tiny_engine):
    eng = tiny_engine("llama")
    prompts = [[5 + i] * (3 + 4 * i) for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sync = LLMEngine(eng, device="cpu", num_kv_blocks=64).generate(prompt_token_ids=prompts, params=params)
    aengine = AsyncLLMEngine(eng, device="cpu", num_kv_blocks=64)
    got, counts = {}, {}

    def consume(i):
        n = 0
        for out in aengine.generate(f"r{i}", prompt_token_ids=prompts[i], params=params):
            n += 1
            last = out
        got[i], counts[i] = last, n

    try:
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert aengine.stats()["kv_blocks_used"] == 0
    finally:
        aengine.shutdown()
    for i, out in enumerate(sync):
        assert got[i].finished and got[i].outputs[0].token_ids == out.outputs[0].token_ids
        assert counts[i] == 12  # one streamed output per generated token


def test_dropped_stream_aborts_and_frees_blocks(tiny_engine):
    aengine = AsyncLLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    try:
        stream = aengine.generate("long", prompt_token_ids=list(range(3, 60)),
                                  params=SamplingParams(max_tokens=150, ignore_eos=True))
        first = next(stream)
        assert not first.finished
        stream.close()  # the consumer goes away mid-generation
        for _ in range(200):
            st = aengine.stats()
            if st["kv_blocks_used"] == 0 and st["num_running"] == 0:
                break
            threading.Event().wait(0.01)
        assert st["kv_blocks_used"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0
        # The engine keeps serving.
        outs = list(aengine.generate("next", prompt_token_ids=[7, 8, 9], params=SamplingParams(max_tokens=3)))
        assert outs[-1].finished
        with pytest.raises(ValueError, match="top_p"):
            aengine.generate("bad", prompt_token_ids=[7], params=SamplingParams(top_p=0))
    finally:
        aengine.shutdown()
    assert not aengine._thread.is_alive()
    with pytest.raises(RuntimeError):
        aengine.generate("late", prompt_token_ids=[1])


def test_submitted_callbacks_match_sync_and_run_on_one_thread(tiny_engine):
    eng = tiny_engine("llama")
    prompts = [[9 + i] * (2 + 5 * i) for i in range(5)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sync = LLMEngine(eng, device="cpu", num_kv_blocks=64).generate(prompt_token_ids=prompts, params=params)
    aengine = AsyncLLMEngine(eng, device="cpu", num_kv_blocks=64)
    outs = {i: [] for i in range(len(prompts))}
    threads = set()
    done = threading.Event()

    def sink(i):
        def on_output(out):
            threads.add(threading.get_ident())
            outs[i].append(out)
            if all(o and o[-1].finished for o in outs.values()):
                done.set()
        return on_output

    try:
        for i, p in enumerate(prompts):
            aengine.submit(f"s{i}", p, params, sink(i))
        assert done.wait(120), "not every request finished"
        assert aengine.stats()["kv_blocks_used"] == 0
    finally:
        aengine.shutdown()
    assert len(threads) == 1 and threading.get_ident() not in threads  # one delivery thread
    for i, ref in enumerate(sync):
        streamed = [t for o in outs[i] for t in o.outputs[0].new_token_ids]
        assert streamed == ref.outputs[0].token_ids and outs[i][-1].outputs[0].token_ids == streamed
        assert sum(o.finished for o in outs[i]) == 1


def test_submit_bad_input_raises_and_engine_error_reaches_callbacks(tiny_engine):
    aengine = AsyncLLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    got = []
    failed = threading.Event()
    try:
        with pytest.raises(ValueError, match="max_tokens"):
            aengine.submit("bad", [3, 4], SamplingParams(max_tokens=10 ** 7), got.append)

        def boom(*a, **k):
            raise RuntimeError("kaboom")
        aengine.engine.runner.run = boom  # an internal error inside the loop's step

        def on_output(item):
            got.append(item)
            failed.set()
        aengine.submit("x", [3, 4, 5], SamplingParams(max_tokens=4), on_output)
        assert failed.wait(30)
    finally:
        aengine.shutdown()
    assert len(got) == 1 and isinstance(got[0], BaseException) and "kaboom" in str(got[0])


def test_full_waiting_queue_refuses_with_overloaded(tiny_engine):
    from tritium.backend.async_engine import EngineOverloadedError
    with pytest.raises(ValueError, match="max_queue_size"):
        AsyncLLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64, max_queue_size=0)
    aengine = AsyncLLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64, max_num_seqs=1, max_queue_size=2)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    try:
        with aengine._cv:  # hold the loop so that nothing is scheduled while the queue fills
            for i in range(2):
                aengine.submit(f"w{i}", [3, 4, 5], long, lambda out: None)
            with pytest.raises(EngineOverloadedError, match="max_queue_size 2"):
                aengine.submit("refused", [3, 4, 5], long, lambda out: None)
            assert aengine.num_rejected == 1 and "refused" not in aengine.engine.requests
        for rid in ("w0", "w1"):
            aengine.abort(rid)
        outs = list(aengine.generate("after", prompt_token_ids=[7, 8], params=SamplingParams(max_tokens=2)))
        assert outs[-1].finished  # room again once the queue drained
    finally:
        aengine.shutdown()


def test_dead_loop_is_unhealthy_and_refuses_new_requests(tiny_engine):
    from tritium.backend.async_engine import EngineDeadError
    aengine = AsyncLLMEngine(tiny_engine("llama"), device="cpu", num_kv_blocks=64)
    failed = threading.Event()
    try:
        assert aengine.is_healthy
        aengine.engine.runner.run = lambda sched: 1 / 0
        aengine.submit("x", [3, 4, 5], SamplingParams(max_tokens=4), lambda item: failed.set())
        assert failed.wait(30)
        assert not aengine.is_healthy
        with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
            aengine.submit("y", [3, 4], SamplingParams(max_tokens=2), lambda item: None)
    finally:
        aengine.shutdown()
