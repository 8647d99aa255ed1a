"""The engine's side of LoRA: turning it on, and resolving a request's adapter."""
from __future__ import annotations

from typing import Optional

from ..errors import RequestError
from .layer import attach
from .manager import LoRAConfig, LoRAManager
from .tp import lora_shard


def enable_lora(engine, config: LoRAConfig) -> LoRAManager:
    """Attach a LoRAManager to an LLMEngine: wrap its model's linears, and have the runner group
    each step's rows by adapter and the scheduler keep at most max_loras adapters per step."""
    if not isinstance(config, LoRAConfig):
        raise ValueError(f"lora must be a LoRAConfig, got {type(config).__name__}")
    check_unsmoothed(engine.config)
    model = engine.runner.model
    shard = lora_shard(engine.config, 0, model) if engine.config.tensor_parallel_size > 1 else None
    manager = LoRAManager(engine.config.model, config, engine.device, model.dtype, shard=shard)
    attach(model, manager)
    if engine.config.tensor_parallel_size > 1:
        engine.runner.enable_lora(manager)  # the workers build the same slots (parallel/runner.py)
    else:
        engine.runner.lora = manager
    engine.scheduler.max_loras = manager.max_loras
    return manager


def check_unsmoothed(cfg) -> None:
    """SmoothQuant (engine.json quantization.smoothquant) divides each smoothed linear's input by
    per-channel factors folded into the norms / v rows / up rows; an adapter trained on the
    original inputs would act on the scaled ones, so such an engine takes no adapters."""
    sq = cfg.quantization.smoothquant
    if sq:
        raise ValueError(f"LoRA: this engine was built with SmoothQuant (engine.json quantization.smoothquant: alpha "
                         f"{sq.get('alpha')}, {sq.get('linears')} linears), which scales each smoothed linear's "
                         f"input; adapters trained on the original inputs cannot apply. Build it with "
                         f"--no-smoothquant (int8 activations without smoothing) or --activation-quant none, or "
                         f"with --lora, which turns SmoothQuant off")


def resolve_request_lora(manager: Optional[LoRAManager], lora_name: Optional[str], lora_task_id: Optional[int]):
    """The adapter object a request asks for (None for the base model); ValueError otherwise."""
    if lora_name is None and lora_task_id is None:
        return None
    if manager is None:
        asked = f"lora_name {lora_name!r}" if lora_name is not None else f"lora_task_id {lora_task_id}"
        raise RequestError(f"{asked}: this engine serves no LoRA adapters (start it with lora adapters, "
                           f"or enable_lora)", field="lora_name" if lora_name is not None else "lora_task_id")
    if lora_name is not None and lora_task_id is not None:
        raise RequestError("give one of lora_name and lora_task_id, not both", field="lora_name")
    if lora_name is not None:
        return manager.resolve(lora_name)
    if isinstance(lora_task_id, bool) or not isinstance(lora_task_id, int) or lora_task_id < 0:
        raise RequestError(f"lora_task_id must be an integer >= 0, got {lora_task_id!r}", field="lora_task_id")
    return manager.resolve_task(lora_task_id)
