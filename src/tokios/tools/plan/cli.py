"""`tokios plan`: capacity planning by formula, printed as a table or as JSON.

Owns the command-line arguments and the rendering; the arithmetic is tools/plan/capacity.py, the model
shapes tools/plan/model_presets.py, the hardware tools/plan/hardware.py. Never imports torch: `this-machine`
is measured once in a child process and cached (see tools/plan/hardware.py).
"""

from __future__ import annotations

import argparse
import json
import math

from tokios.tools.plan.hardware import HARDWARE_NAMES, THIS_MACHINE, load_hardware
from tokios.tools.plan.model_presets import NAME_TO_PRESET, load_model_shape
from tokios.tools.plan.capacity import KV_DTYPES, Plan, PlanInputs, make_plan, parse_weight_bits

DEFAULT_CONTEXT_LEN = 4096


def default_model() -> str:
    """The bundled SmolLM2-135M GGUF when installed, else its preset (same shapes)."""
    from tokios.errors import ModelLoadError
    from tokios.model_files import default_model_path

    try:
        return str(default_model_path())
    except ModelLoadError:
        return "smollm2-135m"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help=f"GGUF file, HF directory or preset ({', '.join(NAME_TO_PRESET)}); "
                        "default: the bundled SmolLM2-135M GGUF")
    parser.add_argument("--hardware", default=THIS_MACHINE, choices=HARDWARE_NAMES,
                        help="hardware preset; this-machine is measured once and cached")
    parser.add_argument("--count", type=int, default=1, help="number of devices")
    parser.add_argument("--weight-bits", default=None,
                        help="bits per weight (number, or fp16, int8, q4_1, q4_k...); default: as "
                        "stored in the model file, 16 for a preset")
    parser.add_argument("--kv-dtype", default="fp16", choices=KV_DTYPES)
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel degree (default: all devices in one group)")
    parser.add_argument("--concurrency", type=int, default=1, help="target concurrent users")
    parser.add_argument("--context", type=int, default=None,
                        help=f"context length per user (default: {DEFAULT_CONTEXT_LEN} or the "
                        "model's maximum if smaller)")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens (TTFT floor; default: the whole context)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens per request")
    parser.add_argument("--acceptance", type=float, default=None,
                        help="speculative decoding acceptance rate a in [0, 1]")
    parser.add_argument("--spec-tokens", type=int, default=4, help="draft tokens per verify (k)")
    parser.add_argument("--draft-cost", type=float, default=0.05,
                        help="cost of one draft step relative to a target step (c)")
    parser.add_argument("--compute-dtype", default=None, choices=["fp32", "bf16", "fp16", "fp8", "int8"],
                        help="dtype of the matrix products (default: bf16, fp32 for 32-bit weights)")
    parser.add_argument("--headroom", type=float, default=0.10,
                        help="fraction of device memory kept free (default 0.10)")
    parser.add_argument("--remeasure", action="store_true",
                        help="measure this-machine again instead of using the cache")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    model = load_model_shape(args.model or default_model())
    hardware = load_hardware(args.hardware, remeasure=args.remeasure)
    context_len = args.context or min(DEFAULT_CONTEXT_LEN, model.max_context_len)
    return PlanInputs(
        model=model, hardware=hardware, count=args.count,
        weight_bits=parse_weight_bits(args.weight_bits) if args.weight_bits else None,
        kv_dtype=args.kv_dtype, tp=args.tp, concurrency=args.concurrency, context_len=context_len,
        prompt_len=args.prompt_len, output_len=args.output_len, acceptance=args.acceptance,
        num_speculative_tokens=args.spec_tokens, draft_cost=args.draft_cost,
        compute_dtype=args.compute_dtype, headroom=args.headroom,
    )


def run(args: argparse.Namespace) -> int:
    inputs = inputs_from_args(args)
    plan = make_plan(inputs)
    if args.json:
        print(json.dumps({"inputs": _inputs_dict(inputs), "plan": plan.to_dict()}, indent=2))
    else:
        print(render_table(inputs, plan))
    return 0


def _inputs_dict(inputs: PlanInputs) -> dict:
    hardware = inputs.hardware
    return {
        "model": inputs.model.name, "num_params": inputs.model.num_params,
        "num_active_params": inputs.model.num_active_params, "num_experts": inputs.model.num_experts,
        "num_experts_per_token": inputs.model.num_experts_per_token,
        "hardware": hardware.name, "memory_bandwidth": hardware.memory_bandwidth,
        "dtype_to_peak_flops": hardware.dtype_to_peak_flops, "count": inputs.count,
        "tp": inputs.tp_size, "weight_bits": inputs.weight_bits, "kv_dtype": inputs.kv_dtype,
        "concurrency": inputs.concurrency, "context_len": inputs.context_len,
        "prompt_len": inputs.prompt_len, "output_len": inputs.output_len,
        "acceptance": inputs.acceptance, "num_speculative_tokens": inputs.num_speculative_tokens,
        "draft_cost": inputs.draft_cost, "headroom": inputs.headroom,
    }


def format_bytes(num_bytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:,.2f} {unit}"
    return f"{num_bytes:,.0f} B"


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _ridge_text(batch_size: float) -> str:
    return "never (each request's KV read outgrows its compute)" if math.isinf(batch_size) \
        else f"batch >= {math.ceil(batch_size):,}"


def _expert_rows(inputs: PlanInputs, plan: Plan) -> list[tuple[str, str]]:
    """A mixture of experts: the memory every expert needs against the weight bytes a step reads,
    at batch 1, at the users a replica serves and in the prefill (none for a dense model)."""
    model = inputs.model
    if not model.is_moe:
        return []
    shared = (f" + a shared expert {model.shared_expert_intermediate_size:,} wide"
              if model.shared_expert_intermediate_size else "")
    users = math.ceil(inputs.concurrency / plan.num_replicas)
    return [
        ("experts", f"{model.num_experts} x {model.expert_intermediate_size:,} wide, "
                    f"{model.num_experts_per_token} per token{shared}: "
                    f"{format_bytes(plan.expert_weight_bytes)} resident, all of them"),
        ("weights read", f"{format_bytes(plan.batch1_weight_bytes_read)} a step at batch 1 "
                         f"({model.num_experts_per_token} of {model.num_experts} experts a layer); "
                         f"{format_bytes(plan.concurrency_weight_bytes_read)} at batch {users:,} "
                         f"({plan.concurrency_num_experts_read:,.1f} expected, uniform routing); "
                         f"{format_bytes(plan.prefill_weight_bytes_read)} for a prefill of {plan.prompt_len:,} tokens"),
    ]


def render_table(inputs: PlanInputs, plan: Plan) -> str:
    model, hardware = inputs.model, inputs.hardware
    measured = " (measured)" if hardware.is_measured else ""
    params = f"{model.num_params / 1e9:,.3f} B params"
    if model.is_moe:
        params += f" ({model.num_active_params / 1e9:,.3f} B active per token)"
    rows: list[tuple[str, str]] = [
        ("model", f"{model.name}: {params}, {model.num_layers} layers, "
                  f"{model.num_heads} heads / {model.num_kv_heads} KV heads x {model.head_dim}"),
        ("hardware", f"{inputs.count} x {hardware.name}{measured}, tensor parallel {inputs.tp_size}, "
                     f"{plan.num_replicas} replica(s); {hardware.memory_bandwidth / 1e9:,.0f} GB/s, "
                     f"{hardware.peak_flops(plan.compute_dtype) / 1e12:,.2f} TFLOP/s {plan.compute_dtype}"),
        ("", ""),
        ("weights", f"{format_bytes(plan.weight_bytes)} ({plan.weight_bits:.2f} bits/weight)"),
        *_expert_rows(inputs, plan),
        ("KV per token", f"{plan.kv_bytes_per_token / 1024:,.1f} KiB ({inputs.kv_dtype})"),
        ("KV per sequence", f"{format_bytes(plan.kv_bytes_per_sequence)} at {inputs.context_len:,} tokens"),
        ("KV for all users", f"{format_bytes(plan.kv_bytes_total)} per replica "
                             f"({inputs.concurrency:,} user(s))"),
        ("activations", f"{format_bytes(plan.activation_bytes)}; runtime "
                        f"{format_bytes(plan.runtime_overhead_bytes)}"),
        ("total", f"{format_bytes(plan.total_bytes)} of {format_bytes(plan.usable_bytes)} usable "
                  f"({format_bytes(plan.memory_bytes)} less {inputs.headroom:.0%} headroom)"),
        ("fits", f"yes, {format_bytes(plan.headroom_bytes)} to spare" if plan.fits
                 else f"NO, short by {format_bytes(-plan.headroom_bytes)}"),
        ("max concurrency", f"{plan.max_concurrency:,} users at {inputs.context_len:,} tokens"),
        ("max context", f"{plan.max_context_len:,} tokens at {inputs.concurrency:,} users "
                        f"(model maximum {model.max_context_len:,})"),
        ("", ""),
        ("batch-1 decode", f"{format_bytes(plan.batch1_step_bytes)} read per step -> TPOT >= "
                           f"{format_seconds(plan.batch1_tpot_s)}, <= {plan.batch1_tokens_per_s:,.1f} tok/s"),
        ("prefill", f"{plan.prompt_len:,} tokens, {plan.prefill_flops / 1e12:,.2f} TFLOP -> TTFT >= "
                    f"{format_seconds(plan.ttft_floor_s)}"),
        ("compute-bound at", f"{_ridge_text(plan.ridge_batch_size_short_context)} (short context); "
                             f"at {plan.decode_context_len:,.0f} tokens: "
                             f"{_ridge_text(plan.ridge_batch_size)}"),
        (f"at {inputs.concurrency:,} users", f"TPOT >= {format_seconds(plan.concurrency_tpot_s)}, "
                                             f"<= {plan.concurrency_tokens_per_s:,.1f} output tok/s total, "
                                             f"{plan.concurrency_regime}"),
    ]
    if plan.spec_speedup is not None:
        rows.append(("speculation", f"a={inputs.acceptance}, k={inputs.num_speculative_tokens}: "
                                    f"{plan.spec_tokens_per_verify:.2f} tokens per verify, "
                                    f"{plan.spec_speedup:.2f}x at c={inputs.draft_cost} -> TPOT >= "
                                    f"{format_seconds(plan.spec_tpot_s)}"))
    width = max(len(label) for label, _ in rows)
    lines = [f"{label:<{width}}  {value}".rstrip() for label, value in rows]
    if plan.suggestions:
        lines += ["", "to make it fit:"]
        lines += [f"  - {s.change}: {s.outcome}" + (" (fits)" if s.fits else "")
                  for s in plan.suggestions]
    return "\n".join(lines)
