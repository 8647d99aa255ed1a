"""LLMEngine: in-flight batching over a paged KV cache. One step = schedule() -> run() -> postprocess().

    engine = LLMEngine("engines/smollm2")
    engine.add_request("a", prompt="Hello", params=SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): print(out.outputs[0].text_delta, end="")

The engine's one job is the step. Around it: admission.py checks and builds requests,
sequence.py appends tokens, checks stops and shapes outputs, speculative/ proposes and verifies,
thread_policy.py picks the threads of a step, parallel/ drives tensor-parallel workers.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, List, Optional

import torch

from . import decode_burst
from .admission import Admission
from .block_manager import BlockManager
from .config import EngineConfig, with_deterministic
from .device_step import DeviceStepOptions
from .errors import RequestError
from .guided import state as guided
from .loader import load_engine
from .kv_budget import cuda_kv_blocks
from .lora.manager import LoRAConfig
from .lora.setup import enable_lora, resolve_request_lora
from .model_runner import ModelRunner, num_blocks_for_budget
from .parallel.runner import ParallelRunner
from .placement import bind_thread, check_utilization, model_device
from .quant import with_activation_quant
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request, RequestOutput, Sequence, SequenceStatus
from .speculative.accept import accept_proposals
from .speculative.config import SpeculativeConfig
from .speculative.speculator import Speculator, make_speculator
from .stats import engine_stats
from .thread_policy import ThreadPolicy

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class LLMEngine:
    """The runtime: owns the model runner, the block manager and the scheduler (not thread-safe;
    AsyncLLMEngine wraps it with a loop thread).

    Open an engine directory (LLMEngine(engine_dir, ...)) or wrap a loaded model
    (LLMEngine(config=cfg, model=model, tokenizer=tok, ...), single rank; from_model is the same).
    speculative / draft_engine: speculative decoding (docs/speculative.md; draft_engine: an
    LLMEngine whose loaded model proposes, instead of loading speculative.draft_engine_dir).
    thread_policy: torch threads per step (None: torch's thread count as it is).
    lora: serve LoRA adapters per request, mixed in one batch (docs/lora.md).
    device_step: device sampling, staged inputs, static decode buffers / CUDA graphs
    (device_step.DeviceStepOptions; default: each on for CUDA, off for CPU; docs/serving.md).
    max_decode_burst: greedy decode steps one native call may run (backend/decode_burst.py;
    default decode_burst.DEFAULT_MAX_DECODE_BURST, 1: off; TRITIUM_DECODE_BURST overrides it).
    """

    def __init__(self, engine_dir: Optional[str] = None, num_kv_blocks: Optional[int] = None,
                 max_num_seqs: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
                 enable_prefix_caching: bool = True, device: Optional[str] = None,
                 kv_cache_memory_bytes: Optional[int] = None, threads_per_rank: Optional[int] = None,
                 speculative: Optional[SpeculativeConfig] = None, *, config: Optional[EngineConfig] = None,
                 model=None, tokenizer=None, draft_engine: Optional["LLMEngine"] = None,
                 thread_policy: Optional[ThreadPolicy] = None,
                 deterministic: Optional[bool] = None,  # None: the engine's own setting
                 activation_quant: Optional[str] = None,  # None: the engine's own setting
                 lora: Optional[LoRAConfig] = None,
                 gpu_memory_utilization: Optional[float] = None, instances_on_device: int = 1,
                 device_step: Optional[DeviceStepOptions] = None, max_decode_burst: Optional[int] = None):
        if speculative is not None:
            speculative.validate()  # before the (slow) load
        if gpu_memory_utilization is not None:
            check_utilization(gpu_memory_utilization)  # docs/serving.md#placement
        self.max_decode_burst = decode_burst.DEFAULT_MAX_DECODE_BURST if max_decode_burst is None \
            else decode_burst.check_max_burst(max_decode_burst)
        if (engine_dir is None) == (model is None):
            raise ValueError("give an engine_dir, or a loaded config and model")
        runner = None
        if engine_dir is not None:
            config, model, tokenizer = load_engine(engine_dir, device)
        config = with_deterministic(config, deterministic)
        config = with_activation_quant(config, activation_quant)
        if engine_dir is not None:
            if config.tensor_parallel_size > 1:  # rank 0 of N: starts the workers (parallel/runner.py)
                runner = ParallelRunner(engine_dir, config, model, model_device(model),
                                        num_kv_blocks, kv_cache_memory_bytes, threads_per_rank,
                                        gpu_memory_utilization=gpu_memory_utilization,
                                        instances_on_device=instances_on_device)
        elif config.tensor_parallel_size > 1:
            raise ValueError("a loaded model must be single-rank; open a tensor-parallel engine with "
                             "LLMEngine(engine_dir), which starts its workers")
        try:
            self.config: EngineConfig = config
            self.tokenizer = tokenizer
            self.device = model_device(model)
            bind_thread(self.device)  # Triton kernels launch on the current device
            loaded_draft = None
            if runner is not None:
                num_kv_blocks = runner.num_blocks  # agreed by every rank
            elif num_kv_blocks is None and kv_cache_memory_bytes is None and self.device.type == "cuda":
                # The budget is shared with the draft engine: load it first (docs/serving.md#placement).
                if speculative is not None and speculative.method == "draft" and draft_engine is None:
                    loaded_draft = load_engine(speculative.draft_engine_dir, str(self.device))
                draft = loaded_draft[:2] if loaded_draft else (
                    (draft_engine.config, draft_engine.runner.model) if draft_engine is not None else None)
                num_kv_blocks, draft_blocks = cuda_kv_blocks(
                    config, model, self.device, gpu_memory_utilization, instances_on_device, draft,
                    speculative.draft_num_kv_blocks if speculative is not None else None)
                if draft_blocks is not None and speculative.draft_num_kv_blocks is None:
                    speculative = dataclasses.replace(speculative, draft_num_kv_blocks=draft_blocks)
            elif num_kv_blocks is None:
                num_kv_blocks = num_blocks_for_budget(config, self.device, kv_cache_memory_bytes)
            elif isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks < 1:
                raise ValueError(f"num_kv_blocks must be an integer >= 1, got {num_kv_blocks!r}")
            self.block_size = config.limits.block_size
            self.max_seq_len = config.limits.max_seq_len
            self.block_manager = BlockManager(num_kv_blocks, self.block_size, enable_prefix_caching)
            self.scheduler = Scheduler(self.block_manager, max_num_seqs or config.limits.max_batch_size,
                                       max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS)
            self.runner = runner or ModelRunner(config, model, num_kv_blocks, self.device,
                                                step_options=device_step or DeviceStepOptions())
            self.admission = Admission(config, tokenizer, self.scheduler.max_num_seqs, num_kv_blocks)
            self.thread_policy = thread_policy
            self.speculator: Optional[Speculator] = None if speculative is None else make_speculator(
                speculative, config, tokenizer, self.device, num_kv_blocks * self.block_size,
                self.scheduler.max_num_seqs, draft_engine, loaded_draft)
            self.lora = None  # LoRAManager: enable_lora()
            if lora is not None:
                self.enable_lora(lora)
        except BaseException:
            if runner is not None:
                runner.close()
            raise
        self.requests: Dict[str, Request] = {}
        self._aborted: List[RequestOutput] = []  # final outputs of aborted requests, for the next step()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0

    @classmethod
    def from_model(cls, cfg: EngineConfig, model, tokenizer=None, **kwargs) -> "LLMEngine":
        """An engine around an already loaded DecoderLM (tests, benchmarks); single rank only."""
        return cls(config=cfg, model=model, tokenizer=tokenizer, **kwargs)

    def enable_lora(self, config: LoRAConfig) -> None:
        """Serve LoRA adapters per request, mixed in one batch (docs/lora.md)."""
        self.lora = enable_lora(self, config)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Optional[str] = None,
                    prompt_token_ids: Optional[List[int]] = None, params: Optional[SamplingParams] = None,
                    priority: int = 0, lora_name: Optional[str] = None, lora_task_id: Optional[int] = None) -> None:
        """Queue a request (with the LoRA adapter lora_name, or tensorrtllm_backend's cached
        lora_task_id; by default params' own). Bad input raises RequestError (a ValueError) naming the field; nothing
        else is touched."""
        if request_id in self.requests:
            raise RequestError(f"request_id {request_id!r} is already in use", field="request_id")
        req = self.admission.build(request_id, prompt, prompt_token_ids,
                                   SamplingParams() if params is None else params, priority)
        if lora_name is None and lora_task_id is None:  # the request fields (sampling_parameters.lora_name, ...)
            lora_name, lora_task_id = req.params.lora_name, req.params.lora_task_id
        lora = resolve_request_lora(self.lora, lora_name, lora_task_id)
        if lora is not None:
            req.lora = lora
            self.lora.count(lora, requests=1, prompt_tokens=len(req.prompt_token_ids))
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
        self._aborted.append(req.output())
        return True

    def abort_all(self) -> None:
        """Abort every request and drop their final outputs (the caller fails them itself)."""
        for rid in list(self.requests):
            self.abort(rid)
        self._aborted.clear()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    @property
    def failure(self) -> Optional[str]:
        """Why the engine cannot run steps any more (a tensor-parallel worker died), or None."""
        return getattr(self.runner, "failure", None)

    # ------------------------------------------------------------------ the step
    def step(self) -> List[RequestOutput]:
        """Run one iteration; returns outputs of the requests that changed."""
        outputs, self._aborted = self._aborted, []
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_seq_len)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        if self.thread_policy is not None:
            self.thread_policy.apply(sched.num_batched_tokens)
        t0 = time.perf_counter()
        k = decode_burst.plan(self, sched)  # several greedy steps in one native call
        tokens = self.runner.run_burst(sched, k, decode_burst.stop_ids(sched)) if k > 1 else None
        if tokens is not None:
            if self.thread_policy is not None:
                self.thread_policy.observe(sched.num_batched_tokens * len(tokens), time.perf_counter() - t0)
            return outputs + decode_burst.postprocess(self, sched, tokens)
        logits = self.runner.run(sched)
        seconds = time.perf_counter() - t0
        if self.thread_policy is not None:
            self.thread_policy.observe(sched.num_batched_tokens, seconds)
        step_outputs, proposed, accepted = self.postprocess(sched, logits)
        if self.speculator is not None:
            self.speculator.observe_step(seconds, len(sched.seqs), sched.num_batched_tokens, proposed, accepted)
        return outputs + step_outputs

    def postprocess(self, sched: SchedulerOutput, logits: torch.Tensor):
        """Advance computed counts, cache full blocks, fork n > 1 samples, sample, verify
        speculative proposals, append tokens. Returns (outputs, proposed, accepted)."""
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
                continue  # its computed count and blocks are settled by accept_proposals
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
        proposed = accepted = 0
        if verifying:
            proposed, accepted = accept_proposals(verifying, logits, self.block_manager, self.speculator.rule,
                                                  lambda seq, tok, entry: self._append(seq, tok, entry, now))
            self.speculator.num_verify_rows += len(verifying)
            for seq, _ in verifying:
                touched[seq.request.request_id] = seq.request
        if sample_seqs:
            if len(rows) != logits.shape[0]:
                logits = logits[torch.tensor(rows)]
            tokens, entries = self.runner.sample(logits, sample_seqs)
            for seq, tok, entry in zip(sample_seqs, tokens, entries):
                self._append(seq, tok, entry, now)
                touched[seq.request.request_id] = seq.request
        return self._outputs(touched, now), proposed, accepted

    def _outputs(self, touched: Dict[str, Request], now: float) -> List[RequestOutput]:
        """The outputs of the requests a step changed; finished ones leave the engine."""
        outs = []
        for rid, req in touched.items():
            outs.append(req.output())
            if req.is_finished:
                req.metrics.finished_time = now
                self.requests.pop(rid, None)
        return outs

    def _append(self, seq: Sequence, tok: int, entry: Optional[dict], now: float) -> None:
        if seq.guide is not None and guided.dead_end(seq, tok, entry, self.scheduler):
            return  # structured outputs: the grammar allowed no token (finish_reason grammar_dead_end)
        self.num_generated_tokens += 1
        if seq.request.lora is not None:
            self.lora.count(seq.request.lora, generated_tokens=1)
        reason = seq.append_token(tok, entry, now, self.max_seq_len)
        if reason is not None:
            self.scheduler.finish(seq, reason)

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
