"""Where an engine runs and how much device memory its KV cache may take (docs/serving.md#placement).

Triton places model instances: an `instance_group { kind: KIND_GPU count: C gpus: [0, 1] }`
runs C instances on each listed GPU and hands each one `model_instance_kind` / `model_instance_device_id`.
`instance_device` turns those into a torch device; `bind_thread` makes that device current in the
thread (or worker process) about to launch kernels: Triton kernels launch on the *current* CUDA
device, so an engine on cuda:1 driven from a thread whose current device is cuda:0 fails at its
first kernel.

KV cache budget (`gpu_memory_utilization`, as in vLLM): that fraction of the device's total memory
is shared by every instance on the device; each instance takes budget / instances_on_device for its
weights, its draft engine's weights, the draft's KV cache and its own KV cache, in that order.
Activations, the CUDA context and the allocator's slack live in the remaining (1 - fraction).

Every CUDA call goes through `cuda` (a `CudaDevice`), so tests replace that one object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

DEFAULT_GPU_MEMORY_UTILIZATION = 0.85


class CudaDevice:
    """The few torch.cuda calls placement needs (tests monkeypatch `placement.cuda`)."""

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def mem_get_info(self, index: int) -> Tuple[int, int]:
        """(free, total) bytes of device `index`."""
        return torch.cuda.mem_get_info(index)


cuda = CudaDevice()


def instance_device(kind: str, device_id, explicit: Optional[str] = None) -> Optional[str]:
    """Triton's model_instance_kind ("GPU", "CPU", "MODEL"; KIND_ prefix accepted) and
    model_instance_device_id (+ the `device` parameter) -> device.

    KIND_GPU -> cuda:<id>; KIND_CPU -> cpu; KIND_MODEL / KIND_AUTO / none -> the parameter, or
    None (the loader's default: cuda when available). A `device` parameter contradicting KIND_GPU
    or KIND_CPU is an error, not a silent override."""
    kind = (kind or "").strip().upper()
    kind = kind if kind.startswith("KIND_") else "KIND_" + kind  # Triton passes "GPU"; configs say KIND_GPU
    if kind == "KIND_GPU":
        try:
            dev = f"cuda:{int(device_id)}"
        except (TypeError, ValueError):
            raise ValueError(f"model_instance_device_id must be an integer for KIND_GPU, got {device_id!r}") from None
        if explicit and torch.device(explicit) != torch.device(dev):
            raise ValueError(f"parameter device {explicit!r} contradicts instance_group KIND_GPU on GPU {device_id} "
                             f"(leave device empty, or use KIND_MODEL)")
        return dev
    if kind == "KIND_CPU":
        if explicit and torch.device(explicit).type != "cpu":
            raise ValueError(f"parameter device {explicit!r} contradicts instance_group KIND_CPU "
                             f"(use KIND_GPU with gpus: [...])")
        return "cpu"
    return explicit or None


def instances_on_device(model_config: dict, device_id) -> int:
    """How many instances of this model Triton places on GPU `device_id` (>= 1): a KIND_GPU group
    puts `count` instances on each of its `gpus` (every visible GPU when none are listed)."""
    n = 0
    for g in model_config.get("instance_group", []) or []:
        if str(g.get("kind", "")).upper() != "KIND_GPU":
            continue
        gpus = [int(x) for x in g.get("gpus", []) or []]
        if not gpus or int(device_id) in gpus:
            n += int(g.get("count", 1))
    return max(n, 1)


def apply_instance_placement(args: dict, model_config: dict, engine_kwargs: dict) -> None:
    """In the Triton backend's initialize(): Triton's instance args -> engine_kwargs["device"]
    (cuda:<id> for KIND_GPU) and instances_on_device, and bind the loading thread to that GPU."""
    kind, dev_id = args.get("model_instance_kind", ""), args.get("model_instance_device_id", "0")
    device = instance_device(kind, dev_id, engine_kwargs.get("device"))
    if device is None:
        return
    engine_kwargs["device"] = device
    if device.startswith("cuda"):
        engine_kwargs.setdefault("instances_on_device", instances_on_device(model_config, dev_id))
        bind_thread(device)  # the load and the warm-up run in this thread


def bind_thread(device) -> None:
    """Make `device` the current CUDA device of the calling thread (no-op off CUDA). Call it at the
    top of every thread or worker process that launches kernels."""
    dev = torch.device(device)
    if dev.type == "cuda":
        cuda.set_device(dev.index if dev.index is not None else 0)


def model_device(model) -> torch.device:
    return next(iter(model.buffers())).device


def module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (its weights on the device)."""
    if module is None:
        return 0
    seen, n = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


@dataclass(frozen=True)
class KvPlan:
    share_bytes: int         # this instance's part of the budget
    target_kv_bytes: int
    draft_kv_bytes: int


def check_utilization(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {value!r}")
    return float(value)


def plan_kv_memory(total_bytes: int, utilization: float, instances: int, weight_bytes: int,
                   target_token_bytes: int, draft_weight_bytes: int = 0, draft_token_bytes: int = 0,
                   draft_kv_bytes: Optional[int] = None) -> KvPlan:
    """Split one instance's share of the budget. The draft's KV cache is taken first: as declared
    (draft_kv_bytes), or else sized to hold as many tokens as the target's (the rest is split in
    proportion to the bytes per token of each). Raises ValueError naming gpu_memory_utilization
    when the weights leave no room."""
    utilization = check_utilization(utilization)
    if instances < 1:
        raise ValueError(f"instances on the device must be >= 1, got {instances}")
    share = int(total_bytes * utilization) // instances
    left = share - weight_bytes - draft_weight_bytes
    if draft_kv_bytes is None:
        draft_kv_bytes = left * draft_token_bytes // (target_token_bytes + draft_token_bytes) if left > 0 else 0
    target = left - draft_kv_bytes
    if target < target_token_bytes or left <= 0:
        gib = 1 << 30
        raise ValueError(
            f"gpu_memory_utilization {utilization} of {total_bytes / gib:.2f} GiB shared by {instances} instance(s) "
            f"gives each {share / gib:.2f} GiB, but the weights take {(weight_bytes + draft_weight_bytes) / gib:.2f} GiB"
            f"{f' and the draft KV cache {draft_kv_bytes / gib:.2f} GiB' if draft_kv_bytes else ''}, leaving no room "
            f"for the KV cache: raise gpu_memory_utilization, run fewer instances on the device, or set num_kv_blocks")
    return KvPlan(share, target, draft_kv_bytes)


def check_fits(device, kv_bytes: int, what: str = "KV cache") -> None:
    """At load, before allocating: the planned bytes must be free on the device now (another
    process, or a budget larger than what is left, would otherwise fail later at random)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    free, total = cuda.mem_get_info(dev.index if dev.index is not None else 0)
    if kv_bytes > free:
        gib = 1 << 30
        raise ValueError(f"{what} of {kv_bytes / gib:.2f} GiB does not fit on {dev}: {free / gib:.2f} GiB free of "
                         f"{total / gib:.2f} GiB; lower gpu_memory_utilization (or num_kv_blocks) or free the device")
