"""Microbenchmarks for the two roofs: peak memory bandwidth and peak matrix throughput per dtype.

Owns `measure_memory_bandwidth`, `measure_matmul_flops` and `measure_roofs`, used by
`tokios roofline` (tools/roofline/cli.py) and, through a child process
(`python -m tokios.tools.roofline.microbench --json`), by the `this-machine` hardware preset in
tools/plan/hardware.py. Runs on CUDA when present, else on the CPU with torch's own thread pool.

Each figure is the best of several repeats: on a shared machine the best run is the one least
disturbed by neighbours, and a roof is by definition the best the machine can do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

MIB = 2**20


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _best_seconds(fn, device: torch.device, num_repeats: int) -> float:
    fn()  # warm-up: page faults, allocator, kernel selection
    _sync(device)
    best = float("inf")
    for _ in range(num_repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_memory_bandwidth(num_bytes: int = 512 * MIB, num_repeats: int = 5) -> float:
    """Bytes/s of a full read (sum) of a buffer far larger than the caches. Decode reads (weights,
    KV) and writes next to nothing, so reading is its roof. A copy counted as read plus write
    gave 54 GB/s on a host whose reads top out at 25 (the two directions overlap), which made
    a decode step at the read limit look like 45% of its roof."""
    device = _device()
    source = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    return num_bytes / _best_seconds(lambda: source.sum(), device, num_repeats)


_NAME_TO_TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul_flops(dtype: str, size: int = 2048, num_repeats: int = 3) -> float:
    """FLOP/s of a square matmul (2 * size^3 FLOPs) in `dtype`; int8: integer multiply-adds of
    int8 x int8 into int32 (torch._int_mm, oneDNN's integer GEMM), the roof of the quantized kernels."""
    device = _device()
    if dtype == "int8":
        a = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)
        b = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=device)
        seconds = _best_seconds(lambda: torch._int_mm(a, b), device, num_repeats)
        return 2 * size**3 / seconds
    torch_dtype = _NAME_TO_TORCH_DTYPE[dtype]
    a = torch.randn(size, size, device=device).to(torch_dtype)
    b = torch.randn(size, size, device=device).to(torch_dtype)
    seconds = _best_seconds(lambda: torch.matmul(a, b), device, num_repeats)
    return 2 * size**3 / seconds


def _has_int_mm() -> bool:
    try:
        torch._int_mm(torch.ones(32, 32, dtype=torch.int8), torch.ones(32, 32, dtype=torch.int8))
    except (AttributeError, RuntimeError):
        return False
    return True


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_roofs(*, quick: bool = False) -> dict:
    """The measurement dict that hardware.spec_from_measurement turns into a HardwareSpec.

    `quick` shrinks the buffers and matrices (for tests); the figures are then rough: a smaller
    buffer may sit partly in a large last-level cache, a smaller matmul underuses the cores.
    """
    device = _device()
    dtypes = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else ["int8"] if _has_int_mm() else [])
    matmul_size = 512 if quick else (8192 if device.type == "cuda" else 2048)
    buffer_bytes = 256 * MIB if quick else (2048 * MIB if device.type == "cuda" else 512 * MIB)
    return {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "num_cpus": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "memory_bytes": _memory_bytes(device),
        "memory_bandwidth": measure_memory_bandwidth(buffer_bytes),
        "dtype_to_peak_flops": {dtype: measure_matmul_flops(dtype, matmul_size) for dtype in dtypes},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="measure memory bandwidth and matmul throughput")
    parser.add_argument("--json", action="store_true", help="print the measurement as JSON")
    parser.add_argument("--quick", action="store_true", help="small sizes (rough figures, for tests)")
    args = parser.parse_args(argv)
    measurement = measure_roofs(quick=args.quick)
    if args.json:
        print(json.dumps(measurement))
    else:
        print(f"memory bandwidth {measurement['memory_bandwidth'] / 1e9:.1f} GB/s")
        for dtype, flops in measurement["dtype_to_peak_flops"].items():
            print(f"{dtype} matmul {flops / 1e9:.1f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
