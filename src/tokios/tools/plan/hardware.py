"""Hardware presets for capacity planning, and the measured `this-machine` entry.

Owns `HardwareSpec` (memory, memory bandwidth, peak matrix throughput per dtype) and
`load_hardware(name)`. Vendor presets are dense (no sparsity) datasheet figures; memory is what
the driver reports (nvidia-smi), which is what a serving process can actually see.

`this-machine` is measured by tools/roofline/microbench.py (a large copy/sum for bandwidth,
torch matmul for fp32 and bf16) and cached in ~/.cache/tokios/hardware.json (or $TOKIOS_CACHE_DIR).
The measurement runs in a child process so that `tokios plan` itself never imports torch and is
instant once the cache exists. Used by tools/plan/capacity.py, tools/plan/cli.py, tools/roofline/cli.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tokios.errors import InvalidRequestError, TokiosError
from tokios.model_files import cache_directory

MIB = 2**20
THIS_MACHINE = "this-machine"
COMPUTE_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    """One device. Bandwidth in bytes/s; `dtype_to_peak_flops` in FLOP/s (dense)."""

    name: str
    memory_bytes: int
    memory_bandwidth: float
    dtype_to_peak_flops: dict[str, float]
    # Memory a runtime keeps for itself before any model byte (CUDA context, library workspaces).
    runtime_overhead_bytes: int = 0
    is_measured: bool = False
    num_cpus: int | None = None

    def peak_flops(self, dtype: str) -> float:
        if dtype in self.dtype_to_peak_flops:
            return self.dtype_to_peak_flops[dtype]
        raise InvalidRequestError(
            f"compute dtype {dtype!r} has no peak for hardware {self.name!r}; "
            f"known: {', '.join(self.dtype_to_peak_flops)}",
            param="compute_dtype",
        )


def _gpu(name: str, memory_mib: int, bandwidth_tb_s: float, fp32_tflops: float, bf16_tflops: float,
         fp8_tflops: float | None, int8_tops: float) -> HardwareSpec:
    peaks = {"fp32": fp32_tflops * 1e12, "bf16": bf16_tflops * 1e12, "fp16": bf16_tflops * 1e12,
             "int8": int8_tops * 1e12}
    if fp8_tflops:
        peaks["fp8"] = fp8_tflops * 1e12
    return HardwareSpec(name, memory_mib * MIB, bandwidth_tb_s * 1e12, peaks,
                        runtime_overhead_bytes=1024 * MIB)


# Dense tensor-core figures from NVIDIA datasheets; fp32 is the non-tensor-core rate.
NAME_TO_HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        _gpu("h100-sxm", 81559, 3.35, 67, 989, 1979, 1979),
        _gpu("h200", 143771, 4.8, 67, 989, 1979, 1979),
        _gpu("a100-80g", 81920, 2.039, 19.5, 312, None, 624),
        _gpu("l4", 23034, 0.300, 30.3, 121, 242.5, 242.5),
        # GeForce: fp16/bf16 tensor rate with fp32 accumulation, as a serving stack runs it.
        _gpu("rtx-4090", 24564, 1.008, 82.6, 165.2, 330.3, 660.6),
    )
}
HARDWARE_NAMES = (*NAME_TO_HARDWARE, THIS_MACHINE)


def cache_path() -> Path:
    return cache_directory() / "hardware.json"


def load_hardware(name: str, *, remeasure: bool = False) -> HardwareSpec:
    if name in NAME_TO_HARDWARE:
        return NAME_TO_HARDWARE[name]
    if name != THIS_MACHINE:
        raise InvalidRequestError(
            f"hardware: unknown preset {name!r}; choose one of {', '.join(HARDWARE_NAMES)}",
            param="hardware",
        )
    cached = None if remeasure else read_cached_this_machine()
    return cached or measure_this_machine()


def _machine_identity() -> dict[str, object]:
    return {"hostname": socket.gethostname(), "num_cpus": os.cpu_count()}


def read_cached_measurement() -> dict | None:
    """The cached measurement of tools/roofline/microbench.py, or None when absent, unreadable or taken
    on another machine."""
    try:
        record = json.loads(cache_path().read_text())
        if record.get("identity") != _machine_identity():
            return None
        return dict(record["measurement"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_cached_this_machine() -> HardwareSpec | None:
    measurement = read_cached_measurement()
    try:
        return None if measurement is None else spec_from_measurement(measurement)
    except (ValueError, KeyError, TypeError):
        return None


def spec_from_measurement(measurement: dict) -> HardwareSpec:
    return HardwareSpec(
        name=THIS_MACHINE,
        memory_bytes=int(measurement["memory_bytes"]),
        memory_bandwidth=float(measurement["memory_bandwidth"]),
        dtype_to_peak_flops={k: float(v) for k, v in measurement["dtype_to_peak_flops"].items()},
        is_measured=True,
        num_cpus=measurement.get("num_cpus"),
    )


def save_this_machine(measurement: dict) -> Path:
    """Cache a measurement of tools/roofline/microbench.py (also called by `tokios roofline` after it
    measures)."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"identity": _machine_identity(), "measured_at": time.time(), "measurement": measurement}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(path)  # atomic: a concurrent plan never reads half a file
    return path


def measure_this_machine(*, quick: bool = False) -> HardwareSpec:
    """Run the microbenchmarks in a child process (keeps torch out of this one) and cache them.
    `quick` uses small sizes (rough figures; for tests)."""
    print("tokios: measuring this machine once (memory bandwidth, matrix throughput); "
          f"cached in {cache_path()}", file=sys.stderr)
    result = subprocess.run([sys.executable, "-m", "tokios.tools.roofline.microbench", "--json",
                             *(["--quick"] if quick else [])],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise TokiosError(f"measuring this machine failed: {result.stderr.strip()[-500:]}")
    measurement = json.loads(result.stdout)
    save_this_machine(measurement)
    return spec_from_measurement(measurement)
