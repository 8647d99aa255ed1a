"""LLMEngine: in-flight batching over a paged KV cache. One step = schedule() -> run() -> postprocess().

    engine = LLMEngine("engines/smollm2")
    engine.add_request("a", prompt="Hello", params=SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): print(out.outputs[0].text_delta, end="")
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from .block_manager import BlockManager, cdiv
from .config import EngineConfig, with_deterministic
from .detokenizer import IncrementalDetokenizer
from .guided import state as guided
from .loader import load_engine
from .model_runner import ModelRunner, num_blocks_for_budget
from .parallel.runner import ParallelRunner
from .prompt_limits import encode_prompt, max_token_chars
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import CompletionOutput, Request, RequestOutput, Sequence, SequenceStatus
from .speculative.config import SpeculativeConfig
from .speculative.draft import DraftProposer
from .speculative.speculator import Speculator
from .speculative.verify import verify
from .stats import engine_stats
from .lora.manager import LoRAConfig
from .lora.setup import enable_lora, resolve_request_lora

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# Steps with fewer tokens than this are "small" (a few decodes): see ThreadPolicy.
SMALL_STEP_TOKENS = 4


class ThreadPolicy:
    """torch intra-op threads per step: `threads` for big steps, `small_step_threads` for steps of
    fewer than SMALL_STEP_TOKENS tokens. In a server every core the engine does not use runs the
    frontend and the response path; during small, memory-bound steps those preempt OpenMP
    workers, which then stall at every barrier (measured on 2 cores through tritonserver: one
    thread decodes a single stream about 1.2x faster than two, while two threads serve a batch of
    16 about 1.15x faster than one). The stalls are far worse while idle OpenMP threads spin
    (libgomp's default): servers run with OMP_WAIT_POLICY=PASSIVE (client/server.py), and at
    load 16 a batch of 16 decoded at 64.4 tokens/s with it against 2.1 without
    (docs/quantization.md, "Build time on shared cores")."""

    def __init__(self, threads: int, small_step_threads: int):
        for name, v in (("num_threads", threads), ("small_step_threads", small_step_threads)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.threads, self.small_step_threads = threads, small_step_threads

    def apply(self, num_tokens: int) -> None:
        n = self.small_step_threads if num_tokens < SMALL_STEP_TOKENS else self.threads
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


class LLMEngine:
    """The runtime: owns the model runner, the block manager and the scheduler (not thread-safe;
    AsyncLLMEngine wraps it with a loop thread)."""

    def __init__(self, engine_dir: str, num_kv_blocks: Optional[int] = None, max_num_seqs: Optional[int] = None,
                 max_num_batched_tokens: Optional[int] = None, enable_prefix_caching: bool = True,
                 device: Optional[str] = None, kv_cache_memory_bytes: Optional[int] = None,
                 threads_per_rank: Optional[int] = None, speculative: Optional[SpeculativeConfig] = None,
                 deterministic: Optional[bool] = None,  # None: the engine's own setting
                 lora: Optional[LoRAConfig] = None):
        if speculative is not None:
            speculative.validate()  # before the (slow) load
        cfg, model, tokenizer = load_engine(engine_dir, device)
        cfg = with_deterministic(cfg, deterministic)
        runner = None
        if cfg.tensor_parallel_size > 1:  # rank 0 of N: starts the workers (parallel/runner.py)
            runner = ParallelRunner(engine_dir, cfg, model, next(iter(model.buffers())).device, num_kv_blocks,
                                    kv_cache_memory_bytes, threads_per_rank)
        try:
            self._setup(cfg, model, tokenizer, num_kv_blocks, max_num_seqs, max_num_batched_tokens,
                        enable_prefix_caching, kv_cache_memory_bytes, runner)
            if speculative is not None:
                self.enable_speculation(speculative)
            if lora is not None:
                self.enable_lora(lora)
        except BaseException:
            if runner is not None:
                runner.close()
            raise

    @classmethod
    def from_model(cls, cfg: EngineConfig, model, tokenizer=None, **kwargs) -> "LLMEngine":
        """Build an engine around an already loaded DecoderLM (tests, benchmarks); single rank only."""
        if cfg.tensor_parallel_size > 1:
            raise ValueError("LLMEngine.from_model takes a single-rank model; open a tensor-parallel engine "
                             "with LLMEngine(engine_dir), which starts its workers")
        self = cls.__new__(cls)
        speculative = kwargs.pop("speculative", None)
        lora = kwargs.pop("lora", None)
        self._setup(cfg, model, tokenizer, kwargs.pop("num_kv_blocks", None), kwargs.pop("max_num_seqs", None),
                    kwargs.pop("max_num_batched_tokens", None), kwargs.pop("enable_prefix_caching", True),
                    kwargs.pop("kv_cache_memory_bytes", None))
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if speculative is not None:
            self.enable_speculation(speculative)
        if lora is not None:
            self.enable_lora(lora)
        return self

    def enable_lora(self, config: LoRAConfig) -> None:
        """Serve LoRA adapters per request, mixed in one batch (docs/lora.md)."""
        self.lora = enable_lora(self, config)

    def enable_speculation(self, config: SpeculativeConfig, draft_engine: Optional["LLMEngine"] = None) -> None:
        """Turn on speculative decoding (docs/speculative.md). Method "draft" loads
        config.draft_engine_dir (or uses draft_engine's model) as the proposer; it must have this
        engine's vocabulary."""
        config.validate()
        draft = None
        if config.method == "draft":
            if draft_engine is None:
                dcfg, dmodel, dtok = load_engine(config.draft_engine_dir, str(self.device))
            else:
                dcfg, dmodel, dtok = draft_engine.config, draft_engine.runner.model, draft_engine.tokenizer
            if dcfg.tensor_parallel_size > 1:
                raise ValueError("the draft engine must be a single-rank engine (tensor_parallel_size 1), "
                                 f"got tensor_parallel_size {dcfg.tensor_parallel_size}")
            num_blocks = config.draft_num_kv_blocks
            if num_blocks is None:  # room for every token the target's pool holds, plus k per sequence
                tokens = self.block_manager.num_blocks * self.block_size
                num_blocks = cdiv(tokens, dcfg.limits.block_size) + self.scheduler.max_num_seqs * cdiv(
                    config.num_speculative_tokens, dcfg.limits.block_size)
            draft = DraftProposer(dcfg, dmodel, dtok, self.config, self.tokenizer, self.device, num_blocks)
        self.speculator = Speculator(config, draft)

    def _setup(self, cfg, model, tokenizer, num_kv_blocks, max_num_seqs, max_num_batched_tokens,
               enable_prefix_caching, kv_cache_memory_bytes, runner=None):
        self.config: EngineConfig = cfg
        self.tokenizer = tokenizer
        self.device = next(iter(model.buffers())).device
        if runner is not None:
            num_kv_blocks = runner.num_blocks  # agreed by every rank
        elif num_kv_blocks is None:
            num_kv_blocks = num_blocks_for_budget(cfg, self.device, kv_cache_memory_bytes)
        elif isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be an integer >= 1, got {num_kv_blocks!r}")
        self.block_size = cfg.limits.block_size
        self.max_seq_len = cfg.limits.max_seq_len
        self.block_manager = BlockManager(num_kv_blocks, self.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs or cfg.limits.max_batch_size,
                                   max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)
        self.runner = runner or ModelRunner(cfg, model, num_kv_blocks, self.device)
        self.requests: Dict[str, Request] = {}
        self._aborted: List[RequestOutput] = []
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0
        self.thread_policy: Optional[ThreadPolicy] = None  # None: torch's thread count as it is
        self._token_chars: Optional[int] = None  # prompt_limits.max_token_chars, computed on first use
        self.speculator: Optional[Speculator] = None  # enable_speculation()
        self._spec_delta = (0, 0)  # (proposed, accepted) tokens of the last step
        self.lora = None  # LoRAManager: enable_lora()

    # ------------------------------------------------------------------ requests
    def _validate(self, request_id, prompt, prompt_token_ids, params, priority) -> List[int]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompt and prompt_token_ids")
        vocab = self.config.model.vocab_size
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer; pass prompt_token_ids")
            if self._token_chars is None:
                self._token_chars = max_token_chars(self.tokenizer)
            ids = encode_prompt(self.tokenizer, prompt, self.max_seq_len, self._token_chars)
        else:
            ids = list(prompt_token_ids)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise ValueError(f"prompt_token_ids entries must be integers in [0, {vocab}), got {t!r}")
        params.validate(self.max_seq_len, vocab, len(ids))
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n must be in [1, {self.scheduler.max_num_seqs}] (max_num_seqs), got {params.n}")
        need = cdiv(len(ids) + params.max_tokens, self.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"request can never fit: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{need} KV blocks of {self.block_size} tokens, the pool has {self.block_manager.num_blocks} "
                f"(raise num_kv_blocks or lower max_tokens)")
        if (params.stop_list or params.bad_words) and self.tokenizer is None:
            raise ValueError("stop strings and bad_words need a tokenizer; this engine has none")
        return ids

    def _bad_words_ids(self, words) -> List[List[int]]:
        out = []
        for w in words:
            for variant in {w, w if w.startswith(" ") else " " + w}:
                ids = self.tokenizer.encode(variant, add_special_tokens=False).ids
                if ids and ids not in out:
                    out.append(ids)
        return out

    def add_request(self, request_id: str, prompt: Optional[str] = None,
                    prompt_token_ids: Optional[List[int]] = None, params: Optional[SamplingParams] = None,
                    priority: int = 0, lora_name: Optional[str] = None, lora_task_id: Optional[int] = None) -> None:
        """Queue a request (with the LoRA adapter lora_name, or tensorrtllm_backend's cached
        lora_task_id). Bad input raises ValueError naming the field; nothing else is touched."""
        params = SamplingParams() if params is None else params
        ids = self._validate(request_id, prompt, prompt_token_ids, params, priority)
        lora = resolve_request_lora(self.lora, lora_name, lora_task_id)
        req = Request(request_id, ids, params, priority, eos_token_ids=self.config.model.eos_token_ids,
                      stop_token_ids=params.stop_token_ids,
                      bad_words_ids=self._bad_words_ids(params.bad_words) if params.bad_words else ())
        if lora is not None:
            req.lora = lora
            self.lora.count(lora, requests=1, prompt_tokens=len(ids))
        for seq in req.seqs:
            seq.detok = IncrementalDetokenizer(self.tokenizer, params.stop_list) if self.tokenizer else None
        self.requests[request_id] = guided.attach(self, req)  # constrained: compile starts, a matcher per sample
        self.scheduler.add(req.seqs[0])

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; its final output (finish_reason "abort") comes with
        the next step(). Returns False if the id is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        req.metrics.finished_time = time.monotonic()
        self._aborted.append(self._make_output(req))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # ------------------------------------------------------------------ the step
    def step(self) -> List[RequestOutput]:
        """Run one iteration; returns outputs of the requests that changed."""
        outputs, self._aborted = self._aborted, []
        if self.speculator is not None:
            self.speculator.propose(self)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        if self.thread_policy is not None:
            self.thread_policy.apply(sched.num_batched_tokens)
        t0 = time.perf_counter()
        logits = self.runner.run(sched)
        seconds = time.perf_counter() - t0
        outputs += self.postprocess(sched, logits)
        if self.speculator is not None:
            self.speculator.observe_step(seconds, len(sched.seqs), sched.num_batched_tokens, *self._spec_delta)
        return outputs

    def postprocess(self, sched: SchedulerOutput, logits: torch.Tensor) -> List[RequestOutput]:
        """Advance computed counts, cache full blocks, fork n > 1 samples, sample, verify
        speculative proposals, check stops."""
        now = time.monotonic()
        self.num_steps += 1
        sample_seqs: List[Sequence] = []
        rows: List[int] = []
        verifying = []  # (seq, first logits row) of sequences that verify a proposal
        num_rows = 0  # logits rows come one per sequence that completed its tokens (1 + k when verifying), in order
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            seq.request.metrics.num_scheduled_tokens += n
            self.num_computed_tokens += n
            if seq.spec_token_ids:
                verifying.append((seq, num_rows))
                num_rows += n
                continue  # its computed count and blocks are settled by _verify
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk: nothing to sample yet
            row, num_rows = num_rows, num_rows + 1
            sample_seqs.append(seq)
            rows.append(row)
            for child in seq.request.seqs:
                if child.status == SequenceStatus.PENDING_FORK:
                    self.scheduler.fork(seq, child)  # shares the prompt's blocks; same logits row
                    sample_seqs.append(child)
                    rows.append(row)
        touched: Dict[str, Request] = {}
        self._spec_delta = (0, 0)
        if verifying:
            self._verify(verifying, logits, now)
            for seq, _ in verifying:
                touched[seq.request.request_id] = seq.request
        if sample_seqs:
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows)]
            tokens, entries = self.runner.sample(logits, sample_seqs)
            for seq, tok, entry in zip(sample_seqs, tokens, entries):
                self._append_token(seq, tok, entry, now)
                touched[seq.request.request_id] = seq.request
        outs = []
        for rid, req in touched.items():
            outs.append(self._make_output(req))
            if req.is_finished:
                req.metrics.finished_time = now
                self.requests.pop(rid, None)
        return outs

    def _verify(self, verifying, logits: torch.Tensor, now: float) -> None:
        """Speculative decoding: accept a prefix of each proposal (verify.verify), roll back the
        K/V of the rejected tokens, append the accepted tokens and the target's own."""
        proposed = accepted = 0
        spec = self.speculator
        with torch.inference_mode():
            for seq, row in verifying:
                proposal, q = seq.spec_token_ids, seq.spec_draft_probs
                k = len(proposal)
                seq.spec_token_ids, seq.spec_draft_probs = [], None
                tokens, entries = verify(logits[row:row + k + 1], seq, proposal, q, spec.rule)
                a = len(tokens) - 1
                proposed += k
                accepted += a
                seq.request.metrics.num_spec_proposed_tokens += k
                seq.request.metrics.num_spec_accepted_tokens += a
                # K/V is valid for token_ids and the accepted proposal; the rest is rolled back.
                seq.num_computed_tokens = seq.num_tokens + k
                self.block_manager.truncate(seq, seq.num_tokens + a)
                for tok, entry in zip(tokens, entries):
                    self._append_token(seq, tok, entry, now)
                    if seq.is_finished:
                        break
                if not seq.is_finished:
                    self.block_manager.cache_full_blocks(seq)
        spec.num_verify_rows += len(verifying)
        self._spec_delta = (proposed, accepted)

    def _append_token(self, seq: Sequence, tok: int, entry: Optional[dict], now: float) -> None:
        req, p = seq.request, seq.request.params
        if seq.guide is not None and guided.dead_end(seq, tok, entry, self.scheduler): return  # noqa: E701
        seq.token_ids.append(tok)
        seq.unreported_token_ids.append(tok)
        self.num_generated_tokens += 1
        m = req.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_output_tokens += 1
        if req.lora is not None:
            self.lora.count(req.lora, generated_tokens=1)
        if entry is not None:
            seq.logprobs.append(entry)
            seq.cum_logprob += entry["logprob"]
        if tok in req.eos_token_ids or tok in req.stop_token_ids:
            # The stop token is reported in token_ids but contributes no text.
            seq.stop_reason = tok
            self.scheduler.finish(seq, "stop")
            return
        if seq.detok is not None:
            stop = seq.detok.add_tokens([tok], check_stop=seq.num_output_tokens >= p.min_tokens)
            if stop is not None:
                seq.stop_reason = stop
                self.scheduler.finish(seq, "stop")
                return
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_seq_len:
            self.scheduler.finish(seq, "length")

    def _make_output(self, req: Request) -> RequestOutput:
        comps = []
        for seq in req.seqs:
            fin = seq.is_finished
            if seq.detok is not None:
                delta = seq.detok.delta(finished=fin)
                text = seq.detok.emitted_text
            else:
                delta = text = ""
            comps.append(CompletionOutput(
                index=seq.index, text=text, text_delta=delta, token_ids=seq.output_token_ids,
                new_token_ids=seq.unreported_token_ids, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                cum_logprob=seq.cum_logprob if seq.logprobs is not None else None))
            seq.unreported_token_ids = []
        return RequestOutput(req.request_id, req.prompt_token_ids, req.is_finished, comps,
                             req.metrics.to_dict())

    # ------------------------------------------------------------------ helpers
    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel engine's worker processes."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Engine counters: KV blocks used/free/cached, running/waiting, preemptions, tokens."""
        return engine_stats(self)

    def generate(self, prompts=None, params=None, prompt_token_ids=None, lora_names=None) -> List[RequestOutput]:
        """Run a list of prompts (or id lists) to completion together; final outputs in input order.
        lora_names: one adapter name (or None) for all, or a list with one per prompt."""
        items = prompts if prompts is not None else prompt_token_ids
        params_list = params if isinstance(params, list) else [params] * len(items)
        loras = lora_names if isinstance(lora_names, list) else [lora_names] * len(items)
        base = f"gen{time.monotonic_ns()}-"
        for i, (item, p, lora) in enumerate(zip(items, params_list, loras)):
            kw = {"prompt": item} if prompts is not None else {"prompt_token_ids": item}
            self.add_request(f"{base}{i}", params=p, lora_name=lora, **kw)
        final: Dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[f"{base}{i}"] for i in range(len(items))]

