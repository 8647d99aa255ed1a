"""LoRAManager: the engine's adapters, their host and device caches, and each step's segments.

- Named adapters (LoRAConfig.adapters: name -> PEFT folder) load on first use into an LRU host
  cache of `max_cpu_loras` adapters; `add_adapter` registers one at run time (no rebuild).
  tensorrtllm_backend's `lora_task_id` adapters arrive as tensors with a request and live in the
  same host cache under "task:ID" (a later request may send the id alone while it is cached).
- Device memory holds `max_loras` adapters in slots of per-linear stacks (A (S, R, in), B^T
  (S, R, out), R = parts x max_lora_rank); an adapter is copied into the least recently used slot
  that the step does not need. The scheduler never puts more than `max_loras` adapters in one step.
  On CPU each linear also keeps its stacks cut to the largest rank loaded (contiguous, rebuilt
  when a slot changes), so the batched GEMMs skip the capacity's zero padding.
- begin_step() groups the step's rows by slot (LoRASegments); every wrapped linear
  (layer.LoRALinear) then adds its delta: the Triton SGMV kernel on CUDA, on CPU the native kernel
  (kernels/cpu_lora.c: every row of the step in one call) or else the grouped GEMMs.
A request holds its adapter object, so evicting it from the host cache never breaks a running one.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from tritium.kernels.lora_cpu import BoundLoRA
from tritium.kernels.lora_ref import LoRASegments
from .adapter import DEFAULT_MAX_LORA_RANK, LoRAAdapter, adapted_linears, check_name, fused_rank_capacity, \
    optional_int, part_shapes, FUSED_PARTS
from ..errors import RequestError
from .peft_folder import load_peft_adapter
from .trtllm_format import adapter_from_trtllm

DEFAULT_MAX_LORAS = 4


@dataclass
class LoRAConfig:
    """Engine options for serving LoRA adapters (docs/lora.md)."""
    adapters: Dict[str, str] = field(default_factory=dict)  # name -> PEFT adapter folder
    max_loras: int = DEFAULT_MAX_LORAS       # adapters in device memory (and at most in one step)
    max_cpu_loras: Optional[int] = None      # adapters cached in host memory; None: max(max_loras, len(adapters))
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK  # largest rank of one module the engine takes

    def validate(self) -> "LoRAConfig":
        optional_int(self.max_loras, "max_loras", 1)
        optional_int(self.max_cpu_loras, "max_cpu_loras", 1)
        optional_int(self.max_lora_rank, "max_lora_rank", 1)
        if not isinstance(self.adapters, dict):
            raise ValueError(f"lora adapters must be a mapping name -> path, got {type(self.adapters).__name__}")
        for name, path in self.adapters.items():
            check_name(name, "lora_adapters")
            if not isinstance(path, str) or not path:
                raise ValueError(f"lora_adapters: adapter {name!r} needs a path")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self


def parse_adapter_list(text: str, option: str = "lora_adapters") -> Dict[str, str]:
    """'name=path,name2=path2' (config.pbtxt parameter / CLI) -> {name: path}."""
    from .adapter import parse_lora_spec
    out: Dict[str, str] = {}
    for item in (s for s in text.split(",") if s.strip()):
        name, path = parse_lora_spec(item, option)
        if name in out:
            raise ValueError(f"{option}: adapter {name!r} is listed twice")
        out[name] = path
    return out


class LoRAManager:
    def __init__(self, model_cfg, config: LoRAConfig, device: torch.device, dtype: torch.dtype,
                 shard: Optional[Dict[str, Tuple[str, torch.Tensor]]] = None):
        self.model_cfg = model_cfg
        self.config = config.validate()
        self.paths: Dict[str, str] = dict(config.adapters)
        self.max_loras = config.max_loras
        self.max_cpu_loras = config.max_cpu_loras or max(config.max_loras, len(self.paths))
        self.max_lora_rank = config.max_lora_rank
        self.device, self.dtype = device, dtype
        # A tensor-parallel rank's part of each engine linear (lora/tp.py): name -> ("out", rows)
        # for column-parallel linears (B keeps those rows), ("in", cols) for row-parallel ones (A
        # keeps those columns); None: whole linears.
        self.shard = shard
        self.record_loads = False  # rank 0 of a TP engine: remember slot loads to send to the workers
        self.pending_loads: List[Tuple[int, LoRAAdapter]] = []
        self.row_slots: Optional[List[int]] = None  # the step's row -> slot (-1: base), with self.batch
        self.slot_ids: Optional[torch.Tensor] = None
        self._lock = threading.Lock()  # host cache: admission threads and the engine loop
        self._host: "OrderedDict[str, LoRAAdapter]" = OrderedDict()
        self.stacks: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(model_cfg.num_layers):
            for name in adapted_linears(model_cfg, layer):  # no MLP stacks on a mixture-of-experts layer
                k, n = self.linear_shape(name)
                r = fused_rank_capacity(name, self.max_lora_rank)
                self.stacks[(layer, name)] = (torch.zeros(self.max_loras, r, k, dtype=dtype, device=device),
                                              torch.zeros(self.max_loras, r, n, dtype=dtype, device=device))
        self._cut: Dict[Tuple[int, str], Optional[BoundLoRA]] = {}  # CPU: stacks cut to the largest rank in use
        self.slot_digest: List[Optional[bytes]] = [None] * self.max_loras
        self.slot_ranks: List[Dict[Tuple[int, str], int]] = [{} for _ in range(self.max_loras)]
        self._slot_lru: "OrderedDict[int, None]" = OrderedDict((s, None) for s in range(self.max_loras))
        self.batch: Optional[LoRASegments] = None  # set by begin_step for the forward pass
        self.num_loads = 0                          # adapters copied into device slots
        self.counters: Dict[str, Dict[str, int]] = {}  # adapter key -> requests / prompt / generated tokens

    # ------------------------------------------------------------------ adapters
    def names(self) -> List[str]:
        return sorted(self.paths)

    def add_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Register (or replace) a named adapter at run time; loads and checks it now."""
        check_name(name)
        adapter = load_peft_adapter(name, path, self.model_cfg, self.max_lora_rank)
        with self._lock:
            self.paths[name] = path
            self._put(name, adapter)
        return adapter

    def resolve(self, name: str) -> LoRAAdapter:
        """The adapter a request names (loaded on demand); ValueError naming it and the reason."""
        if not isinstance(name, str):
            raise RequestError(f"lora_name must be a string, got {name!r}", field="lora_name")
        with self._lock:
            if name not in self.paths:
                served = ", ".join(self.names()) or "(none)"
                raise RequestError(f"unknown LoRA adapter {name!r}; this model serves: {served}", field="lora_name")
            hit = self._host.get(name)
            if hit is not None:
                self._host.move_to_end(name)
                return hit
            path = self.paths[name]
        adapter = load_peft_adapter(name, path, self.model_cfg, self.max_lora_rank)
        with self._lock:
            self._put(name, adapter)
        return adapter

    def register_task(self, task_id: int, weights, config) -> LoRAAdapter:
        """A tensorrtllm_backend adapter sent with a request, cached under its lora_task_id."""
        key = f"task:{task_id}"
        try:
            adapter = adapter_from_trtllm(key, weights, config, self.model_cfg, self.max_lora_rank)
        except ValueError as e:
            raise RequestError(f"lora_task_id {task_id}: {e}", field="lora_weights") from None
        with self._lock:
            old = self._host.get(key)
            if old is not None and old.digest != adapter.digest:
                raise RequestError(f"lora_task_id {task_id} is cached with different weights; send new weights "
                                   f"under a new lora_task_id", field="lora_task_id")
            self._put(key, adapter if old is None else old)
            return self._host[key]

    def resolve_task(self, task_id: int) -> LoRAAdapter:
        with self._lock:
            hit = self._host.get(f"task:{task_id}")
            if hit is None:
                raise RequestError(f"lora_task_id {task_id} is not in the LoRA cache (never sent, or evicted: "
                                   f"max_cpu_loras {self.max_cpu_loras}); send lora_weights and lora_config with it",
                                   field="lora_task_id")
            self._host.move_to_end(f"task:{task_id}")
            return hit

    def _put(self, key: str, adapter: LoRAAdapter) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def cached_keys(self) -> List[str]:
        with self._lock:
            return list(self._host)

    # ------------------------------------------------------------------ counters
    def count(self, adapter: LoRAAdapter, requests: int = 0, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        c = self.counters.setdefault(adapter.key, {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0})
        c["requests"] += requests
        c["prompt_tokens"] += prompt_tokens
        c["generated_tokens"] += generated_tokens

    # ------------------------------------------------------------------ device slots and steps
    def linear_shape(self, name: str) -> Tuple[int, int]:
        """(in, out) features of engine linear `name` on this rank."""
        parts = FUSED_PARTS[name]
        shapes = part_shapes(self.model_cfg)
        k, n = shapes[parts[0]][0], sum(shapes[p][1] for p in parts)
        if self.shard is not None:
            kind, idx = self.shard[name]
            k, n = (k, len(idx)) if kind == "out" else (len(idx), n)
        return k, n

    def _slot_for(self, adapter: LoRAAdapter, keep: set) -> int:
        for s, d in enumerate(self.slot_digest):
            if d == adapter.digest:
                self._slot_lru.move_to_end(s)
                return s
        victim = next(s for s in self._slot_lru if self.slot_digest[s] not in keep)
        self.load_slot(victim, adapter.modules, adapter.digest)
        if self.record_loads:
            self.pending_loads.append((victim, adapter))
        return victim

    def load_slot(self, slot: int, modules: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]],
                  digest: Optional[bytes]) -> None:
        """Copy an adapter's modules (full-size fused A (R, in), B (out, R)) into device slot
        `slot`, each cut to this rank's part of its linear."""
        for a_stack, b_stack in self.stacks.values():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
        ranks = {}
        for key, (a, b) in modules.items():
            if self.shard is not None:
                kind, idx = self.shard[key[1]]
                a, b = (a, b[idx]) if kind == "out" else (a[:, idx], b)
            a_stack, bt_stack = self.stacks[key]
            r = a.shape[0]
            a_stack[slot, :r].copy_(a)
            bt_stack[slot, :r].copy_(b.t())
            ranks[key] = r
        self.slot_digest[slot], self.slot_ranks[slot] = digest, ranks
        self._cut.clear()
        self._slot_lru.move_to_end(slot)
        self.num_loads += 1

    def take_loads(self) -> List[Tuple[int, LoRAAdapter]]:
        out, self.pending_loads = self.pending_loads, []
        return out

    def begin_step(self, seqs, num_new_tokens) -> None:
        """Put the step's adapters in device slots and group its rows by slot (rows follow
        `seqs`, num_new_tokens[i] rows each, as ModelRunner lays the batch out)."""
        adapters = {}
        for seq in seqs:
            ad = seq.request.lora
            if ad is not None:
                adapters[ad.digest] = ad
        if not adapters:
            self.batch, self.row_slots = None, None
            return
        assert len(adapters) <= self.max_loras, "the scheduler admitted more adapters than max_loras"
        slots = {d: self._slot_for(ad, set(adapters)) for d, ad in adapters.items()}
        row_slots: List[Optional[int]] = []
        for seq, n in zip(seqs, num_new_tokens):
            ad = seq.request.lora
            row_slots.extend([None if ad is None else slots[ad.digest]] * n)
        self.begin_rows(row_slots)

    def begin_rows(self, row_slots: List[Optional[int]]) -> None:
        """The next forward's rows use these slots (None: the base model); a TP worker's step."""
        self.row_slots = [-1 if s is None else s for s in row_slots]
        self.slot_ids = torch.tensor(self.row_slots, dtype=torch.int64)  # the native CPU kernel's rows
        self.batch = LoRASegments.from_row_slots(row_slots, self.device)

    def begin_single(self, adapter: LoRAAdapter, num_rows: int) -> None:
        """Every one of the next forward's num_rows rows uses `adapter` (tests, scoring)."""
        slot = self._slot_for(adapter, {adapter.digest})
        self.begin_rows([slot] * num_rows)

    def end_step(self) -> None:
        self.batch = None
        self.row_slots = self.slot_ids = None

    def apply(self, key: Tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base linear's output) += this step's LoRA delta for linear `key`."""
        seg = self.batch
        if x.is_cuda:
            from tritium.kernels.lora_triton import lora_add_sgmv
            a_stack, bt_stack = self.stacks[key]
            return lora_add_sgmv(y, x.contiguous(), a_stack, bt_stack, seg)
        if key not in self._cut:
            ranks = [r.get(key, 0) for r in self.slot_ranks]
            a_stack, bt_stack = self.stacks[key]
            r = max(ranks)
            self._cut[key] = BoundLoRA(a_stack[:, :r], bt_stack[:, :r], torch.tensor(ranks)) if r else None
        cut = self._cut[key]
        if cut is None:  # no loaded adapter touches this linear
            return y
        return cut.add(y, x, seg, self.slot_ids)
