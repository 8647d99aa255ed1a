"""ModelRunner: owns the KV pool, turns a SchedulerOutput into one forward pass, samples.

KV pool: per layer a (k_cache, v_cache) pair, each (num_blocks, block_size, num_kv_heads,
head_dim) (multi-head latent attention: one (num_blocks, block_size, 1, kv_lora_rank +
qk_rope_head_dim) latent cache and an empty view of it), in the engine dtype, or float8_e4m3fn / int8 when the engine's kv_cache.dtype says
so (the model's layers then carry k_scale / v_scale). The pool is zero-filled: padded reads of
never-written slots must be finite, or a masked attention score could still turn into NaN.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np
import torch

from tritium.kernels import gemm_tuning, ops
from tritium.kernels.attention_metadata import AttentionMetadata
from .config import EngineConfig
from .config_moe import kv_cache_token_values
from .models.decoder import TORCH_DTYPES
from .placement import DEFAULT_GPU_MEMORY_UTILIZATION
from .models.linear import DenseLinear, cpu_packing_supported, pack_for_cpu
from .quant import set_activation_quant
from .decode_graphs import StaticDecode
from .gemm_warmup import warm_up_gemms
from .device_step import DeviceStepOptions, StepBuffers, build_metadata
from .native_decode import NativeDecode
from .sampler import Sampler
from .sampler_device import DeviceSampler
from .scheduler import SchedulerOutput
from .step_arrays import StepArrays

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB when no budget and no block count is given on CPU


def kv_cache_dtype(cfg: EngineConfig) -> torch.dtype:
    return KV_CACHE_DTYPES.get(cfg.kv_cache.dtype, TORCH_DTYPES[cfg.dtype])


def kv_bytes_per_block(cfg: EngineConfig) -> int:
    """Bytes of one block across all layers, K and V."""
    m = cfg.model
    elem = torch.empty((), dtype=kv_cache_dtype(cfg)).element_size()
    return m.num_layers * cfg.limits.block_size * kv_cache_token_values(m) * elem


def kv_bytes_per_token(cfg: EngineConfig) -> int:
    """KV-cache bytes one token takes over all layers: 2 Hkv D per layer, or under multi-head latent
    attention (kv_lora_rank + qk_rope_head_dim), times the cache dtype's size."""
    return kv_bytes_per_block(cfg) // cfg.limits.block_size


def alloc_kv_layer(cfg: EngineConfig, num_blocks: int, dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_cache, v_cache); under MLA (latent_cache, an empty view of it)."""
    m, bs = cfg.model, cfg.limits.block_size
    if m.kv_lora_rank:
        latent = torch.zeros((num_blocks, bs, 1, kv_cache_token_values(m)), dtype=dtype, device=device)
        return latent, latent[..., :0]
    shape = (num_blocks, bs, m.num_kv_heads, m.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def num_blocks_for_budget(cfg: EngineConfig, device: torch.device, kv_cache_memory_bytes: Optional[int]) -> int:
    """How many blocks fit the memory budget (bytes); a default budget per device when None."""
    if kv_cache_memory_bytes is None:
        if device.type == "cuda":
            # No budget was planned (placement.plan_kv_memory did not run): the default
            # gpu_memory_utilization share of the whole device less what this process already
            # holds (its weights), never more than is free, instead of a share of free memory
            # that a second instance or a draft engine would also take.
            free, total = torch.cuda.mem_get_info(device)
            share = int(total * DEFAULT_GPU_MEMORY_UTILIZATION) - torch.cuda.memory_allocated(device)
            kv_cache_memory_bytes = max(0, min(free, share))
        else:
            # No point in more than every sequence of a full batch at max length.
            full = cfg.limits.max_batch_size * -(-cfg.limits.max_seq_len // cfg.limits.block_size)
            kv_cache_memory_bytes = min(DEFAULT_CPU_KV_BYTES, full * kv_bytes_per_block(cfg))
    n = kv_cache_memory_bytes // kv_bytes_per_block(cfg)
    if n < 1:
        raise ValueError(f"kv cache memory budget {kv_cache_memory_bytes} bytes holds no block "
                         f"({kv_bytes_per_block(cfg)} bytes each)")
    return int(n)


def _pack_deterministic(model) -> None:
    """EngineConfig.deterministic: pack every dense bf16 weight (and a tied LM head) for the
    native batch-invariant GEMM, never oneDNN (kernels/cpu_linear.py; docs/determinism.md)."""
    for mod in model.modules():
        if isinstance(mod, DenseLinear):
            mod.pack_for_cpu(deterministic=True)
    head = getattr(model, "embed_tokens_weight", None)
    if getattr(model, "lm_head", 1) is None and getattr(model, "embed_tokens", 1) is None \
            and head is not None and cpu_packing_supported(head):
        model.packed_head = pack_for_cpu(head, deterministic=True)


def _graphable(model) -> bool:
    """Static decode buffers need a model whose step has no host-side routing: not a
    mixture-of-experts model (per-expert token counts) and not a tensor-parallel rank."""
    return getattr(model, "tp", None) is None and not any(getattr(layer, "sparse", False)
                                                          for layer in getattr(model, "layers", ()))


class ModelRunner:
    """Runs DecoderLM over the scheduled batch and samples the sequences that completed a step.

    step_options (device_step.DeviceStepOptions): sampling on the device (run() then returns
    logits on the device for sample()), staged inputs, static decode buffers / CUDA graphs
    (docs/serving.md#the-device-step). None: staged inputs on CUDA only, host sampling, no graphs
    (what the draft engine and tensor-parallel ranks use)."""

    def __init__(self, cfg: EngineConfig, model, num_blocks: int, device: torch.device,
                 vocab_size: Optional[int] = None, step_options: Optional[DeviceStepOptions] = None):
        # cfg: this rank's config (parallel_layout.local_config); vocab_size: the full model's.
        if step_options is None:
            step_options = DeviceStepOptions(device_sampling=False, cuda_graphs=False)
        opts = self.step_options = step_options.resolve(device)
        self.cfg = cfg
        self.vocab_size = vocab_size or cfg.model.vocab_size
        self.model = model
        self.device = device
        self.block_size = cfg.limits.block_size
        self.num_blocks = num_blocks
        m = cfg.model
        dtype = kv_cache_dtype(cfg)
        if dtype in (torch.float8_e4m3fn, torch.int8):
            missing = [i for i, layer in enumerate(model.layers) if layer.k_scale is None]
            if missing:
                raise ValueError(f"kv_cache.dtype {cfg.kv_cache.dtype!r} needs layers.N.k_scale/v_scale "
                                 f"in the engine weights; missing for layers {missing[:4]}")
        set_activation_quant(model, cfg.activation_quant)  # W8A8 / W4A8 or weight-only (backend/quant.py)
        if device.type == "cpu" and hasattr(model, "pack_for_cpu"):
            if cfg.deterministic:
                _pack_deterministic(model)
            model.pack_for_cpu()  # bf16 weights packed for their CPU kernels (no-op for other dtypes)
        if device.type == "cuda":
            if cfg.deterministic:
                gemm_tuning.CACHE.batch_invariant = True  # docs/kernels.md#tuned-and-stable-kernels
            # every row bucket of every quantized linear tuned and compiled now, not while serving
            warm_up_gemms(model, TORCH_DTYPES[cfg.dtype], max(cfg.limits.max_batch_size, cfg.limits.max_seq_len))
        static = opts.cuda_graphs and _graphable(model)
        # Static decode: one scratch block past the block manager's, where padding rows write.
        self.scratch_block: Optional[int] = num_blocks if static else None
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = [
            alloc_kv_layer(cfg, num_blocks + int(static), dtype, device) for _ in range(m.num_layers)]
        self.sampler = DeviceSampler() if opts.device_sampling else Sampler()
        self.lora = None  # LoRAManager when the engine serves adapters (backend/lora)
        self.buffers = StepBuffers(device) if opts.staged else None
        self.static_decode: Optional[StaticDecode] = None
        if static:
            self.static_decode = StaticDecode(self, opts.max_graph_batch or cfg.limits.max_batch_size,
                                              use_graphs=device.type == "cuda")
            self.static_decode.capture()  # CUDA: warm-up + one graph per bucket, at load
        # CPU decode-only steps: the native call's inputs in kept buffers (backend/native_decode.py)
        self.native_decode = NativeDecode(self) if (device.type == "cpu" and self.buffers is None and not static
                                                    and hasattr(model, "decode_logits")) else None

    # ------------------------------------------------------------------ batch
    def _copy_blocks(self, copies) -> None:
        if len(copies) == 0:
            return
        src = torch.tensor([int(s) for s, _ in copies], device=self.device)
        dst = torch.tensor([int(d) for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def prepare_arrays(self, sched: SchedulerOutput) -> StepArrays:
        """The step's inputs as host arrays (what a tensor-parallel rank 0 sends to the others)."""
        if all(n == 1 for n in sched.num_new_tokens) and not any(s.spec_token_ids for s in sched.seqs):
            return self._decode_arrays(sched)  # the steady state: one token a sequence, same arrays
        return self._step_arrays(sched)

    def _step_arrays(self, sched: SchedulerOutput) -> StepArrays:
        """prepare_arrays for any step (prompt chunks, decodes, speculative proposals)."""
        bs = self.block_size
        ids: List[int] = []
        positions: List[np.ndarray] = []
        slots: List[np.ndarray] = []
        seq_lens: List[int] = []
        logit_rows: List[int] = []
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + n
            spec = seq.spec_token_ids
            # A speculating decode computes its last token and its proposal (after token_ids).
            ids.extend((seq.token_ids + spec if spec else seq.token_ids)[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            if end == seq.num_tokens + len(spec):
                # One logits row per token to sample; k + 1 for a proposal of k tokens.
                logit_rows.extend(range(len(ids) - 1 - len(spec), len(ids)))
        max_blocks = max(len(s.block_table) for s in sched.seqs)
        tables = np.zeros((len(sched.seqs), max_blocks), dtype=np.int32)
        for i, seq in enumerate(sched.seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        qsl = np.zeros(len(sched.seqs) + 1, dtype=np.int32)
        np.cumsum(sched.num_new_tokens, out=qsl[1:])
        return StepArrays(np.asarray(ids, dtype=np.int64), np.concatenate(positions), np.concatenate(slots), qsl,
                          np.asarray(seq_lens, dtype=np.int32), tables, np.asarray(logit_rows, dtype=np.int64),
                          np.asarray(sched.block_copies, dtype=np.int64).reshape(-1, 2))

    def _decode_arrays(self, sched: SchedulerOutput) -> StepArrays:
        """prepare_arrays for a step of one new token per sequence and no proposals, from Python
        ints (no per-sequence numpy arrays): the same arrays, fewer small allocations."""
        bs = self.block_size
        seqs = sched.seqs
        ids, pos, slots, rows = [], [], [], []
        for i, seq in enumerate(seqs):
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p + 1 == seq.num_tokens:
                rows.append(i)
        n = len(seqs)
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = np.zeros((n, max_blocks), dtype=np.int32)
        for i, seq in enumerate(seqs):
            tables[i, :len(seq.block_table)] = seq.block_table
        seq_lens = np.asarray(pos, dtype=np.int32) + 1
        return StepArrays(np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64),
                          np.asarray(slots, dtype=np.int64), np.arange(n + 1, dtype=np.int32), seq_lens, tables,
                          np.asarray(rows, dtype=np.int64),
                          np.asarray(sched.block_copies, dtype=np.int64).reshape(-1, 2))

    def prepare(self, sched: SchedulerOutput):
        """Flat batch: input ids, positions, AttentionMetadata, and the rows that need logits."""
        return self.inputs(self.prepare_arrays(sched))

    def inputs(self, a: StepArrays):
        """Device tensors and AttentionMetadata from a step's host arrays; the rows that need
        logits as a device tensor (staged) or a host list."""
        if self.buffers is not None:
            ids, pos, slots, qsl, lens, tables, rows = self.buffers.upload(a)
            meta = build_metadata(a, slots, qsl, lens, tables, self.cfg.deterministic)
            meta.cpu_plan = ops.attention_plan(meta)  # CPU: attention state; Triton: meta.split
            return ids, pos, meta, rows
        dev = self.device
        query_lens = np.diff(a.query_start_loc).tolist()
        seq_lens = a.seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(a.slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(a.query_start_loc).to(dev),
            seq_lens=torch.from_numpy(a.seq_lens).to(dev),
            block_tables=torch.from_numpy(a.block_tables).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            deterministic=self.cfg.deterministic,
        )
        meta.cpu_plan = ops.attention_plan(meta)  # once per step, shared by the layers
        return (torch.from_numpy(a.input_ids).to(dev), torch.from_numpy(a.positions).to(dev), meta,
                a.logit_rows.tolist())

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput) -> torch.Tensor:
        """One forward pass. Returns float32 logits (on CPU), one row per sequence that completes
        its tokens this step (in sched.seqs order), 1 + k rows for one verifying k proposed
        tokens; partial prompt chunks get no row."""
        if self.native_decode is not None:  # a decode-only CPU step in one native call
            logits = self.native_decode.run(sched, self.lora is None)
            if logits is not None:
                return logits
        arrays = self.prepare_arrays(sched)
        if self.lora is None:
            return self.execute(arrays)
        self.lora.begin_step(sched.seqs, sched.num_new_tokens)  # rows grouped by adapter
        try:
            return self.execute(arrays)
        finally:
            self.lora.end_step()

    def burst_ready(self) -> bool:
        """Whether run_burst can run this model's decode-only steps (checked before the engine
        takes a burst's KV slots)."""
        return self.native_decode is not None and self.lora is None and hasattr(self.model, "can_burst") \
            and self.model.can_burst()

    @torch.inference_mode()
    def run_burst(self, sched: SchedulerOutput, k: int, stop_ids: List[List[int]]) -> Optional[List[List[int]]]:
        """Up to k greedy decode steps of a decode-only step in one native call
        (backend/decode_burst.py; each row's blocks cover its next k tokens): every step's tokens
        (a list of one token per row), or None where this step or model does not take it."""
        if self.native_decode is None or self.lora is not None:
            return None
        return self.native_decode.run_burst(sched, k, stop_ids)

    @torch.inference_mode()
    def execute(self, arrays: StepArrays) -> Optional[torch.Tensor]:
        """The forward pass over prepared arrays (every tensor-parallel rank runs this; ranks other
        than 0 get None back)."""
        self._copy_blocks(arrays.block_copies)
        if self.static_decode is not None:
            bucket = self.static_decode.bucket_for(arrays, self.lora is not None)
            if bucket is not None:
                return self._logits_out(self.static_decode.run(arrays, bucket))
        input_ids, positions, meta, logit_rows = self.inputs(arrays)
        if isinstance(logit_rows, list) and 0 < len(logit_rows) == input_ids.shape[0] \
                and hasattr(self.model, "decode_logits"):  # every row: one native call, head and argmax in it
            out = self.model.decode_logits(input_ids, positions, self.kv_caches, meta)
            if out is not None:
                self._argmax = out
                return out[0]
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if len(logit_rows) == 0:
            return torch.empty(0, self.vocab_size, device=self.device if self.step_options.device_sampling else "cpu")
        # Only the last token of a finished prompt or a decode needs the LM head.
        if isinstance(logit_rows, torch.Tensor):
            rows = hidden if logit_rows.shape[0] == hidden.shape[0] and arrays.logit_rows[-1] == len(logit_rows) - 1 \
                else hidden.index_select(0, logit_rows)
        elif len(logit_rows) == hidden.shape[0]:
            rows = hidden  # every row, in order (the rows are increasing): a decode step
        else:
            rows = hidden[torch.tensor(logit_rows, device=hidden.device)]
        return self._logits_out(self.model.compute_logits(rows))

    def _logits_out(self, logits: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """float32 logits: on the device for the device sampler, else on the host."""
        if logits is None:
            return None
        return logits.float() if self.step_options.device_sampling else logits.float().cpu()

    _argmax = None  # (logits, each row's argmax) of the last native step that ran the head

    def sample(self, logits: torch.Tensor, seqs) -> Tuple[List[int], List[Optional[dict]]]:
        argmax, self._argmax = self._argmax, None
        with torch.inference_mode():
            if argmax is not None and argmax[0] is logits and isinstance(self.sampler, Sampler):
                return self.sampler(logits, seqs, argmax=argmax[1])  # the rows' greedy tokens, taken in C
            return self.sampler(logits, seqs)
