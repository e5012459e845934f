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


def measure_matmul_flops(dtype: str, size: int = 2048, num_repeats: int = 3, with_kernels: bool = True) -> float:
    """FLOP/s of a square matmul (2 * size^3 FLOPs) in `dtype`; int8: integer multiply-adds of
    int8 x int8 into int32, the roof of the quantized kernels: the faster of torch._int_mm
    (oneDNN's integer GEMM) and, on the CPU, our own Q8_0 kernel. Without AVX-512 VNNI oneDNN's
    ran at 1.3 GFLOP/s on an AVX2 host (Zen 3), a hundredth of the fp32 roof, which called every
    quantized engine step "compute-bound, 2,000-4,000% of peak". with_kernels=False leaves our
    kernel out (it may have to be compiled first)."""
    device = _device()
    if dtype == "int8":
        def int_mm_flops(n: int) -> float:
            a = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
            b = torch.randint(-127, 128, (n, n), dtype=torch.int8, device=device)
            return 2 * n**3 / _best_seconds(lambda: torch._int_mm(a, b), device, num_repeats)

        best = _measure_quantized_kernel_flops(size, num_repeats) if device.type == "cpu" and with_kernels else 0.0
        # A small probe first: where oneDNN has no integer vector path, the full size alone took
        # 13 s a repeat.
        if _has_int_mm() and int_mm_flops(256) > best / 4:
            best = max(best, int_mm_flops(size))
        return best
    torch_dtype = _NAME_TO_TORCH_DTYPE[dtype]
    a = torch.randn(size, size, device=device).to(torch_dtype)
    b = torch.randn(size, size, device=device).to(torch_dtype)
    seconds = _best_seconds(lambda: torch.matmul(a, b), device, num_repeats)
    return 2 * size**3 / seconds


def _measure_quantized_kernel_flops(size: int, num_repeats: int) -> float:
    """FLOP/s of the C++ Q8_0 kernel (8-bit activations, integer dot products) on a size x size
    weight and size rows; 0 where the kernel has no vector path (it then falls back to torch)."""
    from tokios.model.kernels import has_vector_kernels, load_extension, make_quantized_linear

    extension = load_extension()
    if extension is None or not has_vector_kernels(extension):
        return 0.0
    linear = make_quantized_linear(torch.randn(size, size), None, "int8")
    x = torch.randn(size, size)
    return 2 * size**3 / _best_seconds(lambda: linear(x), torch.device("cpu"), num_repeats)


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
    buffer may sit partly in a large last-level cache, a smaller matmul underuses the cores, and
    the int8 roof leaves our quantized kernel out.
    """
    device = _device()
    dtypes = ["fp32", "bf16"] + (["fp16"] if device.type == "cuda" else ["int8"])
    matmul_size = 512 if quick else (8192 if device.type == "cuda" else 2048)
    buffer_bytes = 256 * MIB if quick else (2048 * MIB if device.type == "cuda" else 512 * MIB)
    return {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "num_cpus": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "memory_bytes": _memory_bytes(device),
        "memory_bandwidth": measure_memory_bandwidth(buffer_bytes),
        # int8 is left out where nothing measured it (no integer GEMM, no vector kernel).
        "dtype_to_peak_flops": {dtype: flops for dtype in dtypes
                                if (flops := measure_matmul_flops(dtype, matmul_size, with_kernels=not quick)) > 0},
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
