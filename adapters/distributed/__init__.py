"""Serving beyond one process on torch.distributed (PD, context and tensor parallelism).

PD disaggregation: `pd` (the prefill → decode protocol over point-to-point messages) and
`pd_pools` (whole pages' rows of `KVPools`, gathered and scattered by page id); the core side
is `shadowradix.transfer`. docs/distributed.md, "PD disaggregation".
"""
