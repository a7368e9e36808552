"""One forward step over the pools: the paged step, top-k selection, bounded replay, CUDA-graph
decode and verify, the MTP layer.
"""
