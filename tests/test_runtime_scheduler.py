"""Token-budget scheduler: chunked prefill, decode-first mixing, preemption of the newest, priority."""
from tritium.backend.block_manager import BlockManager
from tritium.backend.sampling_params import SamplingParams
from tritium.backend.scheduler import Scheduler
from tritium.backend.sequence import Request, SequenceStatus


def make(num_blocks=16, block_size=4, max_num_seqs=8, budget=8):
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def add(sched, rid, prompt_len, priority=0, n=1):
    req = Request(rid, list(range(1000 + len(rid) * 100, 1000 + len(rid) * 100 + prompt_len)),
                  SamplingParams(max_tokens=100, n=n), priority=priority)
    sched.add(req.seqs[0])
    return req.seqs[0]


def finish_step(bm, out):
    """What the engine does after run(): advance counts, cache blocks, append a token when done."""
    for s, n in zip(out.seqs, out.num_new_tokens):
        s.num_computed_tokens += n
        bm.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def test_chunked_prefill_falls_out_of_the_budget():
    bm, sched = make(budget=8)
    a = add(sched, "a", 20)
    chunks = []
    for _ in range(4):
        out = sched.schedule()
        chunks.append(list(out.num_new_tokens))
        finish_step(bm, out)
    assert chunks == [[8], [8], [4], [1]]
    assert a.block_table == [0, 1, 2, 3, 4, 5]  # 21 tokens -> 6 blocks of 4


def test_decodes_first_then_prompt_chunks_fill_the_budget():
    bm, sched = make(budget=8)
    a = add(sched, "a", 3)
    b = add(sched, "bb", 3)
    out = sched.schedule()
    assert [s is x for s, x in zip(out.seqs, (a, b))] == [True, True] and out.num_new_tokens == [3, 3]
    finish_step(bm, out)
    c = add(sched, "ccc", 10)
    out = sched.schedule()
    assert out.seqs == [a, b, c] and out.num_new_tokens == [1, 1, 6]
    assert out.num_batched_tokens == 8


def test_preempts_newest_running_and_recomputes():
    bm, sched = make(num_blocks=4, block_size=4, budget=64)
    a = add(sched, "a", 8)   # blocks 0, 1
    b = add(sched, "bb", 7)  # blocks 2, 3 -> pool full
    out = sched.schedule()
    finish_step(bm, out)     # a: 9 tokens (its 9th needs a third block), b: 8 tokens (fits)
    assert bm.num_free_blocks == 0
    out = sched.schedule()
    # a (oldest) needs a block -> b, the newest, is preempted; a runs alone, in b's tail block.
    assert out.preempted == [b]
    assert out.seqs == [a] and out.num_new_tokens == [1]
    assert a.block_table == [0, 1, 3]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1 and sched.waiting == [b]
    # Once a finishes, b is readmitted: its full prompt block (2) is still cached, so it
    # recomputes only the rest, prompt tail + its generated token.
    finish_step(bm, out)
    sched.finish(a, "length")
    out = sched.schedule()
    assert out.seqs == [b] and out.num_new_tokens == [4]
    assert b.block_table[0] == 2
    assert b.request.metrics.num_preemptions == 1


def test_preempts_itself_when_it_is_the_newest():
    bm, sched = make(num_blocks=3, block_size=4, budget=64)
    a = add(sched, "a", 4)
    b = add(sched, "bb", 4)
    finish_step(bm, sched.schedule())   # a, b: 5 tokens each, 1 block each, 1 free
    out = sched.schedule()              # a gets the last block; b cannot append -> preempts itself
    assert out.seqs == [a] and out.preempted == [b]


def test_priority_orders_the_waiting_queue():
    bm, sched = make(budget=100, max_num_seqs=2)
    low = add(sched, "low", 4, priority=5)
    high = add(sched, "high", 4, priority=-1)
    mid = add(sched, "mid", 4, priority=0)
    out = sched.schedule()
    assert out.seqs == [high, mid]      # max_num_seqs 2: low waits
    assert sched.waiting == [low]


def test_preemption_picks_the_lowest_priority_victim_not_the_newest():
    bm, sched = make(num_blocks=4, block_size=4, budget=64)
    low = add(sched, "low", 7, priority=5)     # arrives first
    high = add(sched, "high", 8, priority=-1)  # arrives second: the newest
    out = sched.schedule()
    assert out.seqs == [high, low]
    finish_step(bm, out)     # high: 9 tokens (its 9th needs a third block), low: 8 tokens (fits)
    assert bm.num_free_blocks == 0
    out = sched.schedule()
    # FCFS would preempt `high` (the newest, so it would give up its own place); by priority the
    # victim is `low`, and high runs on in low's freed block.
    assert out.preempted == [low]
    assert out.seqs == [high] and out.num_new_tokens == [1] and len(high.block_table) == 3
    assert low.status == SequenceStatus.WAITING and low.block_table == []
    assert sched.waiting == [low] and sched.num_preemptions == 1


def test_max_num_seqs_counts_forked_samples():
    bm, sched = make(budget=100, max_num_seqs=3)
    a = add(sched, "a", 4, n=2)
    b = add(sched, "bb", 4, n=2)
    out = sched.schedule()
    assert out.seqs == [a]               # b's 2 samples would make 4 > 3


def test_decode_step_arrays_equal_the_general_ones():
    # A step of one new token per sequence takes ModelRunner's Python-int path; the general path
    # (numpy per sequence, written for prompt chunks and proposals) is the oracle on the same step.
    import types

    import numpy as np

    from tritium.backend.model_runner import ModelRunner
    from tritium.backend.scheduler import SchedulerOutput
    out = SchedulerOutput(block_copies=[(3, 7)])
    for i, (prompt, done, table) in enumerate([(5, 5, [2, 9]), (9, 12, [4, 1, 6, 11]), (5, 2, [5, 8])]):
        req = Request(f"r{i}", list(range(10, 10 + prompt)), SamplingParams(max_tokens=8))
        seq = req.seqs[0]
        seq.token_ids.extend(range(100, 100 + max(done + 1 - prompt, 0)))
        seq.num_computed_tokens, seq.block_table = done, table
        out.seqs.append(seq)
        out.num_new_tokens.append(1)
    runner = types.SimpleNamespace(block_size=4)
    fast = ModelRunner._decode_arrays(runner, out)
    ref = ModelRunner._step_arrays(runner, out)
    for name, a, b in zip(ref._fields, fast, ref):
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert fast.slot_mapping.tolist() == [9 * 4 + 1, 11 * 4 + 0, 5 * 4 + 2]
    assert fast.logit_rows.tolist() == [0, 1]  # the third computes a prompt token that is not its last
