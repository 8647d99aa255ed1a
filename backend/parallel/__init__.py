"""Tensor parallelism over torch.distributed (Megatron-LM's column/row-parallel split)."""
