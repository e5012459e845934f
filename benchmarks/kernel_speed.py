"""The quantized dot kernel alone, per block type: time per product and GB/s of weights at 1 row,
GOPS (2 x weights x rows per second) at several row counts. Random weights quantized with our own
quantizers (model/blocks); best of --repeats rounds of --iterations calls, in one process.

    python benchmarks/kernel_speed.py --out-features 8192 --in-features 2048 --rows 1,4,16,64
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tokios.model.blocks import KERNEL_TYPES, quantize
from tokios.model.kernels import QuantizedLinear, kernel_status
from tokios.model.quant import PackedWeight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(t.name for t in sorted(KERNEL_TYPES, key=lambda t: t.value)))
    parser.add_argument("--out-features", type=int, default=8192)
    parser.add_argument("--in-features", type=int, default=2048)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.out_features, args.in_features
    weight = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    print(f"{kernel_status()}; {n} x {k} weights, {args.threads} threads")
    print("| type | bits/weight | " + " | ".join(f"{rows} rows" for rows in args.rows.split(",")) + " |")
    print("|---|---|" + "---|" * len(args.rows.split(",")))
    for name in args.types.split(","):
        ggml_type = T[name]
        packed = PackedWeight(torch.from_numpy(quantize(weight, ggml_type)).reshape(n, -1), ggml_type, (n, k))
        linear = QuantizedLinear(packed, None)
        cells = []
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            linear(x)
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                for _ in range(args.iterations):
                    linear(x)
                best = min(best, (time.perf_counter() - started) / args.iterations)
            gops = 2 * n * k * rows / best / 1e9
            cell = f"{best * 1e3:.2f} ms, {gops:.0f} GOPS"
            if rows == 1:
                cell += f", {linear.num_bytes() / best / 1e9:.1f} GB/s"
            cells.append(cell)
        print(f"| {name} | {8 * linear.num_bytes() / (n * k):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
