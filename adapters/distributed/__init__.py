"""Serving beyond one process on torch.distributed (PD, context and tensor parallelism)."""
