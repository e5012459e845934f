"""`tokios roofline`: measure the machine's roofs, then the engine's prefill and decode against them.

Owns the command line and the report. The roofs come from tools/roofline/microbench.py (and refresh
the `this-machine` cache of tools/plan/hardware.py), the engine points from tools/roofline/measure.py,
the classification from tools/roofline/roofs.py and the PNG from tools/roofline/chart.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from tokios.config import SUPPORTED_KV_CACHE_DTYPES
from tokios.errors import InvalidRequestError, TokiosError
from tokios.tools.roofline.roofs import Roofs, RooflinePoint, verdict

ENGINE_DTYPE_TO_COMPUTE_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int8": "int8"}


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of integers >= 1")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    parser.add_argument("--dtype", default="auto",
                        help="engine dtype: auto, float32, bfloat16, int8, int4 (default auto)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(SUPPORTED_KV_CACHE_DTYPES),
                        help="the engine's KV cache element type (default auto); a decode point's bytes count "
                             "its context in this format")
    parser.add_argument("--kv-cache-memory", default="512MiB",
                        help="the engine's KV cache memory (default 512MiB); long --decode-prompt-len at large "
                             "batch sizes need more")
    parser.add_argument("--compute-dtype", default=None, choices=["fp32", "bf16", "fp16", "int8"],
                        help="which matmul roof the engine's steps are held to (default: from --dtype)")
    parser.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8, 16],
                        help="decode batch sizes (default 1,2,4,8,16)")
    parser.add_argument("--prompt-lens", type=_int_list, default=[64, 256, 1024],
                        help="prefill prompt lengths (default 64,256,1024)")
    parser.add_argument("--decode-prompt-len", type=int, default=32,
                        help="prompt length of the decode requests (default 32)")
    parser.add_argument("--decode-steps", type=_int_list, default=[4, 20],
                        help="the two output lengths whose difference times decode (default 4,20)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per point; the best counts")
    parser.add_argument("--chart", default=None,
                        help="PNG path (default: roofline.png in the tokios cache, ~/.cache/tokios or "
                             "$TOKIOS_CACHE_DIR; the report says where)")
    parser.add_argument("--skip-engine", action="store_true", help="measure the roofs only")
    parser.add_argument("--cached-roofs", action="store_true",
                        help="use this machine's roofs from the last full run (the tokios cache) instead of "
                             "measuring them again; measures them when there are none")
    parser.add_argument("--quick", action="store_true",
                        help="small microbenchmarks (lower bounds; not cached for tokios plan)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from tokios.tools.plan import hardware
    from tokios.tools.roofline import microbench

    if len(args.decode_steps) != 2:
        raise InvalidRequestError("decode_steps: give exactly two output lengths, e.g. 4,20",
                                  param="decode_steps")
    measurement = hardware.read_cached_measurement() if args.cached_roofs else None
    if measurement is None:
        measurement = microbench.measure_roofs(quick=args.quick)
        if not args.quick:
            hardware.save_this_machine(measurement)
    bandwidth = measurement["memory_bandwidth"]
    roofs_list = [Roofs(bandwidth, flops, dtype)
                  for dtype, flops in measurement["dtype_to_peak_flops"].items()]
    points: list[RooflinePoint] = []
    engine_dtype = args.dtype
    if not args.skip_engine:
        engine_dtype, points = _measure_engine(args)
    compute_dtype = args.compute_dtype or ENGINE_DTYPE_TO_COMPUTE_DTYPE.get(engine_dtype, "bf16")
    roofs = next((r for r in roofs_list if r.dtype == compute_dtype), roofs_list[0])
    chart_path = None
    if points or args.chart:
        from tokios.model_files import cache_directory
        from tokios.tools.roofline.chart import draw_roofline_chart

        chart_path = draw_roofline_chart(roofs_list, points, args.chart or cache_directory() / "roofline.png",
                                         title=f"Roofline: {measurement['device']}, engine {engine_dtype}")
    if args.json:
        print(json.dumps({"measurement": measurement, "engine_dtype": engine_dtype, "roof_dtype": roofs.dtype,
                          "points": [p.summary(roofs) for p in points],
                          "chart": str(chart_path) if chart_path else None}, indent=2))
    else:
        print(render_report(measurement, roofs, points, chart_path))
    return 0


def _measure_engine(args: argparse.Namespace) -> tuple[str, list[RooflinePoint]]:
    """(the engine's resolved dtype, its prefill and decode points)."""
    from tokios.tools.roofline.measure import measure_decode_utilization, measure_prefill_utilization

    try:
        from tokios.engine import LLM
    except ImportError as exc:
        raise TokiosError(f"the engine is not available ({exc}); run with --skip-engine") from exc
    max_batch = max(args.batch_sizes)
    longest = max(max(args.prompt_lens), args.decode_prompt_len + max(args.decode_steps))
    print(f"loading the engine ({args.dtype})...", file=sys.stderr)
    engine = LLM(model=args.model, dtype=args.dtype, max_num_seqs=max(max_batch, 1),
                 max_num_batched_tokens=max(longest, max_batch), kv_cache_dtype=args.kv_cache_dtype,
                 kv_cache_memory=args.kv_cache_memory)
    print("measuring prefill...", file=sys.stderr)
    points = measure_prefill_utilization(engine, args.prompt_lens, num_repeats=args.repeats)
    print("measuring decode...", file=sys.stderr)
    points += measure_decode_utilization(engine, args.batch_sizes, prompt_len=args.decode_prompt_len,
                                         num_steps=tuple(args.decode_steps), num_repeats=args.repeats)
    return _engine_compute_dtype(engine, args.dtype), points


def _engine_compute_dtype(engine, requested: str) -> str:
    """The dtype of the engine's matrix products, so the right roof is used: int8 where its
    linear layers run on the quantized kernels (8-bit activations times block integers, whatever
    the block type), else the activation dtype of the weight format it resolved."""
    model = getattr(getattr(engine, "core", None), "model", None)
    if model is not None and model.can_fuse_decode:
        return "int8"
    weight_format = getattr(getattr(engine, "core", None), "weight_format", None) or requested
    try:
        from tokios.model.dtypes import ACTIVATION_DTYPE
    except ImportError:
        return weight_format
    torch_dtype = ACTIVATION_DTYPE.get(weight_format)
    return str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else weight_format


def render_report(measurement: dict, roofs: Roofs, points: list[RooflinePoint], chart_path) -> str:
    lines = [f"device: {measurement['device']}, {measurement.get('num_threads')} threads",
             f"peak memory bandwidth: {measurement['memory_bandwidth'] / 1e9:,.1f} GB/s"]
    for dtype, flops in measurement["dtype_to_peak_flops"].items():
        ridge = flops / measurement["memory_bandwidth"]
        lines.append(f"peak {dtype} matmul: {flops / 1e9:,.1f} GFLOP/s (ridge at {ridge:,.1f} FLOPs/byte)")
    if points:
        lines += ["", f"engine points, held to the {roofs.dtype} roof:",
                  f"{'point':<26}{'FLOP/byte':>10}{'GFLOP/s':>10}{'GB/s':>8}{'%FLOP':>7}{'%BW':>6}"
                  f"{'tok/s':>9}  regime"]
        for point in points:
            s = point.summary(roofs)
            lines.append(f"{point.label:<26}{s['arithmetic_intensity']:>10.2f}"
                         f"{s['achieved_flops'] / 1e9:>10.1f}{s['achieved_bandwidth'] / 1e9:>8.2f}"
                         f"{s['percent_of_peak_flops']:>6.0f}%{s['percent_of_peak_bandwidth']:>5.0f}%"
                         f"{s['tokens_per_s']:>9.1f}  {s['regime']}")
        lines.append("")
        lines += [verdict(point, roofs) for point in points]
    if chart_path:
        lines += ["", f"chart: {chart_path}"]
    return "\n".join(lines)
