"""What a bench ran on, for its results' header: the CPU, cores, memory and versions."""
from __future__ import annotations

import os
import platform

from bench.memory import GiB, meminfo


def machine(*packages: str) -> dict:
    """The CPU's model name, cores, torch's CPU capability, total memory, the versions of torch,
    Ray and Python, and of each of ``packages`` (None when it is not installed)."""
    import ray
    import torch

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    out = {"cpu": cpu, "cores": os.cpu_count(), "capability": torch.backends.cpu.get_cpu_capability(),
           "mem_total_gib": round(meminfo("MemTotal") / GiB, 1), "torch": torch.__version__,
           "ray": ray.__version__, "python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = __import__(pkg).__version__
        except ImportError:
            out[pkg] = None
    return out
