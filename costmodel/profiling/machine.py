"""The machine a profile was measured on: platform, memory and load.

Units: bytes. A profile records these next to its timings, since other work
on the machine and its core count decide what the timings mean.
"""

from __future__ import annotations

import os
import platform
from typing import Any

__all__ = ["device_memory_per_rank", "load_average", "machine_info", "physical_memory"]


def machine_info() -> dict[str, Any]:
    """Platform, CPU count, torch version and (when present) the GPU."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(), "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "memory_bytes": physical_memory(),
        "loadavg": load_average(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def physical_memory() -> int | None:
    """This machine's RAM in bytes; None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_per_rank(device: str, ranks: int) -> int | None:
    """Bytes each of ``ranks`` ranks has: GPU 0's memory on ``'cuda'``, an
    equal share of the RAM on ``'cpu'`` (None where the RAM is unknown)."""
    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    phys = physical_memory()
    return phys // ranks if phys else None
