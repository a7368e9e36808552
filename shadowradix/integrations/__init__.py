"""Adapters from the core to what engines and operators already run (optional dependencies).

* `protocol`: `PrefixCache`, what an engine needs from a prefix cache; `radix` implements it over
  `ShadowRadixCache`, `naive` is a deliberately simple full-token reference (an oracle, an A/B
  baseline).
* `sglang`: an SGLang-shaped tree cache (sglang 0.5.18's ``BasePrefixCache`` names);
  `sglang0523` (records `sglang0523_types`, locks `sglang0523_locks`, the scheduler's helpers
  `sglang0523_common`): sglang 0.5.23's call shapes over it; `vllm`: a vLLM-shaped
  ``KVCacheManager``. None imports its engine (docs/integrations.md).
* `prometheus`: a Prometheus collector (``pip install shadowradix[metrics]``).
"""
