"""The serving loop: the continuous-batching runner (admission, prefill, decode, overlap,
emission), sampling and speculative decoding.
"""
