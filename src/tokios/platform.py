"""The machine this process runs on: its physical CPU cores and the device the engine runs on.

Imports nothing of tokios, so every layer may ask it: the engine sizes its thread pool with
physical_core_count, the parallel group's ranks share the cores with it, and the engine places the
model with resolve_device. torch is imported only to choose a device, so counting cores stays
cheap for the commands that never load a model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def physical_core_count() -> int:
    """Cores this process may run on, counting a core's hyper-threads once: the kernels are
    bound by memory bandwidth and vector units, which a core's second thread does not add."""
    try:
        logical = len(os.sched_getaffinity(0))
    except AttributeError:
        logical = os.cpu_count() or 1
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as handle:
            siblings = handle.read().strip()
        threads_per_core = len(siblings.replace("-", ",").split(",")) if siblings else 1
    except OSError:
        threads_per_core = 1
    return max(1, logical // max(1, threads_per_core))


def resolve_device(name: str) -> torch.device:
    """--device: auto is CUDA when present, else the CPU; any other name as torch reads it."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
