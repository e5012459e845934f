"""The C++ paged decode attention alone (decode_attention_rows) at long context: ms per layer, the
KV bytes it must read per second (each KV head's keys and values once per pass), and GFLOPS
(4 x heads x head_dim per query-key pair). Three shapes per context length: one decode row,
8 decode rows of 8 requests (8 contexts), and one 8-row prompt chunk (one context, the rows
sharing passes over it). Random caches of each --kv-dtypes format (bfloat16; int8 with its
per token-head scales, kv_cache/dtypes.py) in blocks of --block-size slots, as the engine lays them;
best of --repeats rounds of --iterations calls. GB/s counts the bytes of the format read.
--layers N calls N caches in turn, as a step's layers are: with 30, a long context's KV comes
from memory, not from L3 (one 4,096-token context is 3 MB a layer in bfloat16). --read-baseline
adds a row per context: a plain read (torch.sum) of as many bytes per layer as its cache holds
for the context, the layers in turn, timed the same way. Against what reading alone costs, the
decode row's time (in cache with --layers 1, from memory with --layers 30) shows whether its
reads overlap its arithmetic.

    python benchmarks/attention_speed.py --contexts 512,4096,8192 --heads 9 --kv-heads 3 --head-dim 64
    python benchmarks/attention_speed.py --contexts 4096,8192 --kv-dtypes bfloat16 --layers 30
    python benchmarks/attention_speed.py --contexts 4096 --layers 30 --block-order in-order --read-baseline
"""

from __future__ import annotations

import argparse
import time

import torch

from tokios.kv_cache.dtypes import kv_bytes_per_element
from tokios.model.attention import quantize_kv
from tokios.model.kernels import kernel_status, load_extension


def block_slots(num_blocks: int, block: int, length: int, generator: torch.Generator,
                first_block: int | None = None) -> torch.Tensor:
    """A context's slots: blocks drawn at random, or consecutive from first_block (a fresh engine's)."""
    count = (length + block - 1) // block
    if first_block is None:
        blocks = torch.randperm(num_blocks, generator=generator)[:count]
    else:
        blocks = torch.arange(first_block, first_block + count)
    return (blocks[:, None] * block + torch.arange(block)).reshape(-1)[:length]


def best_seconds_per_layer(call, args) -> float:
    """The best of --repeats rounds of --iterations calls, per call and per layer."""
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        for _ in range(args.iterations):
            call()
        best = min(best, (time.perf_counter() - started) / args.iterations / args.layers)
    return best


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
    parser.add_argument("--block-size", type=int, default=16, help="slots per KV block (the engine's --block-size)")
    parser.add_argument("--block-order", choices=["random", "in-order"], default="random",
                        help="where a context's blocks lie: scattered (a long-running server's) or consecutive")
    parser.add_argument("--layers", type=int, default=1,
                        help="caches called in turn, as a step's layers are: 30 puts a long context out of L3")
    parser.add_argument("--read-baseline", action="store_true",
                        help="also time a plain read of the bytes one decode row reads, layer by layer")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    extension = load_extension()
    print(kernel_status())
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
    generator = torch.Generator().manual_seed(0)
    print("| context | KV dtype | shape | ms / layer | KV GB/s | GFLOPS |")
    print("|---|---|---|---|---|---|")
    for context, kv_dtype in ((int(c), d) for c in args.contexts.split(",") for d in args.kv_dtypes.split(",")):
        block = args.block_size
        num_blocks = 8 * (context // block + 2)
        caches = []
        for _ in range(args.layers):
            keys = torch.randn(num_blocks * block, kv_heads, head_dim, generator=generator)
            values = torch.randn(num_blocks * block, kv_heads, head_dim, generator=generator)
            if kv_dtype == "int8":
                pair = (quantize_kv(keys), quantize_kv(values))
            else:
                pair = (keys.to(getattr(torch, kv_dtype)), values.to(getattr(torch, kv_dtype)))
            caches.append(pair)
        element_bytes = kv_bytes_per_element(kv_dtype, head_dim)

        def slots(length: int, request: int = 0) -> torch.Tensor:
            first_block = None if args.block_order == "random" else request * (context // block + 2)
            return block_slots(num_blocks, block, length, generator, first_block)

        chunk = slots(context + 8)
        shapes = {
            "1 decode row": ([context], [slots(context)]),
            "8 decode rows, 8 requests": ([context] * 8, [slots(context, request) for request in range(8)]),
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
                for keys, values in caches:
                    extension.decode_attention(qkv, keys, values, table, context_lens, heads, kv_heads, head_dim,
                                               head_dim ** -0.5)

            call()
            best = best_seconds_per_layer(call, args)
            distinct_contexts = 1 if name.endswith("chunk") else rows
            kv_bytes = distinct_contexts * max(lengths) * kv_heads * head_dim * 2 * element_bytes
            pairs = sum(lengths) * heads
            print(f"| {context} | {kv_dtype} | {name} | {best * 1e3:.3f} | {kv_bytes / best / 1e9:.1f} | "
                  f"{pairs * head_dim * 4 / best / 1e9:.1f} |")
        if args.read_baseline:
            # As many bytes as each layer's K and V for `context` slots, in float32 buffers of their
            # own (the caches' bytes read as floats would hold denormals, which slow the sum).
            buffers = [torch.ones(cache[:context].numel() * cache.element_size() // 4)
                       for pair in caches for cache in pair]

            def read():
                for buffer in buffers:
                    buffer.sum()

            best = best_seconds_per_layer(read, args)
            kv_bytes = sum(buffer.numel() * 4 for buffer in buffers) / args.layers
            print(f"| {context} | {kv_dtype} | plain read of a decode row's bytes | {best * 1e3:.3f} | "
                  f"{kv_bytes / best / 1e9:.1f} | - |")


if __name__ == "__main__":
    main()
