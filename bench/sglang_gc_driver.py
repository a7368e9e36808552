"""Run the SGLang driver unchanged, with ``gc.collect()`` before each of its timed runs.

``bench/peer_trace.py --gc-collect`` starts every timed run of both caches from a collected heap:
ours in its own process, SGLang's through this wrapper (the driver file itself is not touched).
Without it, the garbage of each harness's setup (torch imports, the workload drawn with torch)
lands a full collection of ~100 ms in whichever timed run comes first.

    python bench/sglang_gc_driver.py ../shared/peers/sglang_swa_driver.py --reqs 2000 ...
"""

import gc
import importlib.util
import sys


def main() -> None:
    driver = sys.argv[1]
    sys.argv = [driver, *sys.argv[2:]]
    spec = importlib.util.spec_from_file_location("sglang_swa_driver", driver)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timed_run = module.run

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        gc.collect()
        return timed_run(*args, **kwargs)

    module.run = run  # main() looks the name up when it calls it
    module.main()


if __name__ == "__main__":
    main()
