"""Where a measurement was taken, and whether we run in quick mode.

Quick mode (``SPECNB_QUICK=1``, set by ``make test`` and CI; also on when ``CI``
is set) shrinks sizes so notebooks run as tests; the book is built in full mode.
"""
from __future__ import annotations

import os
import platform


def quick_mode() -> bool:
    """True when sizes should shrink for tests."""
    default = "1" if os.environ.get("CI") else "0"
    return os.environ.get("SPECNB_QUICK", default).strip().lower() not in ("0", "", "false", "no")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(model=None) -> dict:
    """Machine and library versions, for every printed timing and every results file.

    ``kernels`` names the kernels ``model`` runs (:mod:`specnb.kernels`), or without a model the
    kernels most recently applied in this process."""
    import torch
    import transformers

    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }
    from .kernels import in_use, kernels_of

    kernels = kernels_of(model) if model is not None else in_use()
    info["kernels"] = (kernels.label if kernels is not None
                       else "kernels not chosen yet (specnb chooses them when it loads a model)")
    try:
        with open("/proc/meminfo") as f:
            info["memory_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def machine_line(model=None) -> str:
    """One line: CPU, cores, memory, torch and transformers versions, kernels (of ``model`` if given)."""
    i = machine_info(model)
    where = i["gpu"] or f"{i['cpu']}, {i['cores']} cores ({i['torch_threads']} torch threads)"
    mem = f", {i['memory_gib']} GiB" if "memory_gib" in i else ""
    return (f"{where}{mem}; Python {i['python']}, torch {i['torch']}, transformers {i['transformers']}; "
            f"{i['kernels']}")
