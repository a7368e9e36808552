"""What every bench result file records: the commit, the full command, the machine, the date."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The commit under test: ``SHADOWRADIX_COMMIT`` (a copied tree without ``.git``, as on the
    lent GPU machine), else ``git rev-parse HEAD`` (with ``+dirty`` for local changes)."""
    if os.environ.get("SHADOWRADIX_COMMIT"):
        return os.environ["SHADOWRADIX_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_meta() -> dict[str, object]:
    import torch

    meta: dict[str, object] = dict(
        commit=commit(),
        command=" ".join([Path(sys.executable).name] + sys.argv),
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        python=platform.python_version(),
        torch=torch.__version__,
        host=platform.node(),
    )
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(machine=props.name, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        meta.update(machine=platform.processor() or platform.machine())
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta
