"""The embedded DeepSeek-V4-style model: config and presets, weights, layer maths, the dense
reference forward (the oracle) and the byte tokenizer. Knows nothing of pools or scheduling.
"""
