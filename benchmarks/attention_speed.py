"""The C++ paged decode attention alone (decode_attention_rows) at long context: ms per layer, the
KV bytes it must read per second (each KV head's keys and values once per pass), and GFLOPS
(4 x heads x head_dim per query-key pair). Three shapes per context length: one decode row,
8 decode rows of 8 requests (8 contexts), and one 8-row prompt chunk (one context, the rows
sharing passes over it). Random caches of each --kv-dtypes format (bfloat16; int8 with its
per token-head scales, kv_cache/dtypes.py) in blocks of 16 slots, as the engine lays them;
best of --repeats rounds of --iterations calls. GB/s counts the bytes of the format read.

    python benchmarks/attention_speed.py --contexts 512,4096,8192 --heads 9 --kv-heads 3 --head-dim 64
"""

from __future__ import annotations

import argparse
import time

import torch

from tokios.kv_cache.dtypes import kv_bytes_per_element
from tokios.model.attention import quantize_kv
from tokios.model.kernels import kernel_status, load_extension

BLOCK = 16


def block_slots(num_blocks: int, length: int, generator: torch.Generator) -> torch.Tensor:
    blocks = torch.randperm(num_blocks, generator=generator)[:(length + BLOCK - 1) // BLOCK]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,4096,8192")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtypes", default="bfloat16,int8")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extension = load_extension()
    print(kernel_status())
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    generator = torch.Generator().manual_seed(0)
    print("| context | KV dtype | shape | ms / layer | KV GB/s | GFLOPS |")
    print("|---|---|---|---|---|---|")
    for context, kv_dtype in ((int(c), d) for c in args.contexts.split(",") for d in args.kv_dtypes.split(",")):
        num_blocks = 8 * (context // BLOCK + 2)
        keys = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=generator)
        values = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=generator)
        if kv_dtype == "int8":
            keys, values = quantize_kv(keys), quantize_kv(values)
        else:
            keys, values = keys.to(getattr(torch, kv_dtype)), values.to(getattr(torch, kv_dtype))
        element_bytes = kv_bytes_per_element(kv_dtype, head_dim)
        chunk = block_slots(num_blocks, context + 8, generator)
        shapes = {
            "1 decode row": ([context], [block_slots(num_blocks, context, generator)]),
            "8 decode rows, 8 requests": ([context] * 8, [block_slots(num_blocks, context, generator)
                                                          for _ in range(8)]),
            "8-row prompt chunk": ([context + 1 + i for i in range(8)], [chunk] * 8),
        }
        for name, (lengths, slot_rows) in shapes.items():
            rows = len(lengths)
            table = torch.zeros(rows, max(lengths), dtype=torch.long)
            for row, (length, slots) in enumerate(zip(lengths, slot_rows)):
                table[row, :length] = slots[:length]
            context_lens = torch.tensor(lengths)
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=generator)

            def call():
                extension.decode_attention(qkv, keys, values, table, context_lens, heads, kv_heads, head_dim,
                                           head_dim ** -0.5)

            call()
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                for _ in range(args.iterations):
                    call()
                best = min(best, (time.perf_counter() - started) / args.iterations)
            distinct_contexts = 1 if name.endswith("chunk") else rows
            kv_bytes = distinct_contexts * max(lengths) * kv_heads * head_dim * 2 * element_bytes
            pairs = sum(lengths) * heads
            print(f"| {context} | {kv_dtype} | {name} | {best * 1e3:.3f} | {kv_bytes / best / 1e9:.1f} | "
                  f"{pairs * head_dim * 4 / best / 1e9:.1f} |")


if __name__ == "__main__":
    main()
