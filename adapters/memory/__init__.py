"""Where the KV lives on the device: pools, cache formats, the HiSparse executor, device block
tables, budget-sized and re-balanced pools.
"""
