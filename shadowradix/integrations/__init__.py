"""Adapters from the core to what engines and operators already run (optional dependencies).

* `protocol`: `PrefixCache`, what an engine needs from a prefix cache; `radix` implements it over
  `ShadowRadixCache`, `naive` is a deliberately simple full-token reference (an oracle, an A/B
  baseline).
* `sglang`: an SGLang-shaped tree cache (``BasePrefixCache`` names); `vllm`: a vLLM-shaped
  ``KVCacheManager``. Neither imports its engine (docs/integrations.md).
* `prometheus`: a Prometheus collector (``pip install shadowradix[metrics]``).
"""
