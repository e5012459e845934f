"""Capacity planning by formula: does a model and workload fit, and how fast can it be served.

Owns `PlanInputs` (validated), `Plan` (every figure `tokios plan` prints) and `make_plan`, plus
the advice when it does not fit (`Suggestion`). Pure arithmetic over tools/plan/formulas.py, given a
ModelShape (model/shape.py) and a HardwareSpec (tools/plan/hardware.py); the command line and
table live in tools/plan/cli.py. No torch, no I/O.

Memory model (why each term): the devices of one tensor-parallel group hold one full copy of the
weights (`count / tp` such replicas serve users in parallel); each device keeps `headroom` of its
memory free (allocator fragmentation, the unexpected) and loses the runtime's own overhead
(CUDA context, workspaces); activations are sized for a prefill chunk of `MAX_BATCHED_TOKENS`
tokens plus the logits of a full batch; what remains holds the KV cache.

A mixture of experts holds every expert (the weights are all of them) while a step reads the
dense part and the experts its tokens chose (formulas.weight_bytes_read, uniform routing): k of
n at batch 1, more at the target concurrency and in a prefill. The plan reports both sides.
"""

from __future__ import annotations

import dataclasses
import math

from tokios.errors import InvalidRequestError
from tokios.kv_cache.dtypes import kv_bytes_per_element
from tokios.model.shape import ModelShape
from tokios.tools.plan import formulas
from tokios.tools.plan.hardware import HardwareSpec

MAX_BATCHED_TOKENS = 2048  # prefill chunk the activation estimate is sized for (vLLM's default)
MAX_LOGITS_ROWS = 256  # logits rows sized for (vLLM's default max_num_seqs)

WEIGHT_DTYPE_TO_BITS = {
    "fp32": 32.0, "fp16": 16.0, "bf16": 16.0, "fp8": 8.0, "int8": 8.0, "int4": 4.0,
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k": 5.5, "q5_0": 5.5, "q5_1": 6.0,
    "q4_k": 4.5, "q4_0": 4.5, "q4_1": 5.0,
}
# Bytes per element: kv_cache/dtypes.py, the engine's own arithmetic (int8 carries a float32
# scale per token and head, as `tokios serve --kv-cache-dtype int8` stores it).
KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    model: ModelShape
    hardware: HardwareSpec
    count: int = 1
    weight_bits: float | None = None  # None: as stored in the model file (16 for a preset)
    kv_dtype: str = "fp16"
    tp: int | None = None  # None: all `count` devices in one tensor-parallel group
    concurrency: int = 1
    context_len: int = 4096
    prompt_len: int | None = None  # None: the whole context is prompt (the worst TTFT)
    output_len: int | None = None
    acceptance: float | None = None  # speculative decoding acceptance rate, None: no speculation
    num_speculative_tokens: int = 4
    draft_cost: float = 0.05  # one draft step's cost relative to a target step
    compute_dtype: str | None = None  # None: fp32 for 32-bit weights, else bf16 (or fp16)
    headroom: float = 0.10

    def __post_init__(self) -> None:
        _check_int("count", self.count, 1, 4096)
        _check_int("concurrency", self.concurrency, 1, 10**6)
        _check_int("context", self.context_len, 1, 10**8)
        _check_int("spec_tokens", self.num_speculative_tokens, 1, 64)
        if self.tp is not None:
            _check_int("tp", self.tp, 1, self.count)
            if self.count % self.tp:
                raise InvalidRequestError(
                    f"tp: {self.tp} must divide count {self.count} (each replica is a whole "
                    "tensor-parallel group)", param="tp")
        problem = tensor_parallel_problem(self.model, self.tp_size)
        if problem is not None:
            valid = [tp for tp in range(1, self.count + 1) if self.count % tp == 0
                     and tensor_parallel_problem(self.model, tp) is None]
            source = "tp" if self.tp is not None else "count"
            raise InvalidRequestError(
                f"{source}: a tensor-parallel group of {self.tp_size} cannot split {self.model.name}: {problem}; "
                f"with {self.count} device(s) give --tp {' or '.join(map(str, valid))}", param=source)
        if self.prompt_len is not None:
            _check_int("prompt_len", self.prompt_len, 1, self.context_len)
        if self.output_len is not None:
            _check_int("output_len", self.output_len, 1, self.context_len - (self.prompt_len or 0))
        if self.weight_bits is not None and not 1 <= self.weight_bits <= 32:
            raise InvalidRequestError(f"weight_bits: {self.weight_bits} must be within [1, 32]",
                                      param="weight_bits")
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(
                f"kv_dtype: {self.kv_dtype!r} must be one of {', '.join(KV_DTYPES)}",
                param="kv_dtype")
        if self.acceptance is not None and not 0 <= self.acceptance <= 1:
            raise InvalidRequestError(f"acceptance: {self.acceptance} must be within [0, 1]",
                                      param="acceptance")
        if not 0 <= self.draft_cost <= 1:
            raise InvalidRequestError(f"draft_cost: {self.draft_cost} must be within [0, 1]",
                                      param="draft_cost")
        if not 0 <= self.headroom < 1:
            raise InvalidRequestError(f"headroom: {self.headroom} must be within [0, 1)",
                                      param="headroom")

    @property
    def tp_size(self) -> int:
        return self.tp or self.count

    @property
    def num_replicas(self) -> int:
        return self.count // self.tp_size

    @property
    def kv_bytes_per_element(self) -> float:
        return kv_bytes_per_element(self.kv_dtype, self.model.head_dim)

    @property
    def resolved_compute_dtype(self) -> str:
        if self.compute_dtype:
            return self.compute_dtype
        bits = self.weight_bits or self.model.file_weight_bits or 16
        if bits >= 32:
            return "fp32"
        return "bf16" if "bf16" in self.hardware.dtype_to_peak_flops else "fp16"


def _check_int(field: str, value: int, low: int, high: int) -> None:
    if not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{field}: {value!r} must be an integer within [{low}, {high}]",
                                  param=field)


def parse_weight_bits(text: str) -> float:
    """'q4_1', 'int8', 'bf16' or a number of bits."""
    key = text.strip().lower()
    if key in WEIGHT_DTYPE_TO_BITS:
        return WEIGHT_DTYPE_TO_BITS[key]
    try:
        return float(key)
    except ValueError:
        raise InvalidRequestError(
            f"weight_bits: {text!r} is neither a number of bits in [1, 32] nor one of "
            f"{', '.join(WEIGHT_DTYPE_TO_BITS)}", param="weight_bits") from None


@dataclasses.dataclass(frozen=True)
class Suggestion:
    change: str  # what to change, e.g. "KV cache in fp8"
    outcome: str  # its number, e.g. "fits 12 users at 4,096 tokens"
    fits: bool  # whether this change alone makes the target fit


@dataclasses.dataclass(frozen=True)
class Plan:
    compute_dtype: str
    num_replicas: int
    weight_bytes: float
    weight_bits: float
    num_params: int
    num_active_params: int  # a mixture of experts: less the routed experts a token does not use
    expert_weight_bytes: float  # every routed expert, all resident (0 for a dense model)
    kv_bytes_per_token: float
    kv_bytes_per_sequence: float
    kv_bytes_total: float
    activation_bytes: float
    runtime_overhead_bytes: float
    total_bytes: float  # per replica: weights + KV + activations + runtime overhead
    memory_bytes: float  # per replica
    usable_bytes: float  # per replica, after headroom
    headroom_bytes: float  # usable - total; negative when it does not fit
    fits: bool
    max_concurrency: int  # at the target context, all replicas
    max_context_len: int  # at the target concurrency, capped at the model's context
    kv_capacity_tokens: int  # per replica
    decode_context_len: float
    batch1_step_bytes: float
    batch1_weight_bytes_read: float
    batch1_tpot_s: float
    batch1_tokens_per_s: float
    prompt_len: int
    prefill_flops: float
    prefill_weight_bytes_read: float
    ttft_floor_s: float
    ridge_batch_size: float  # at the decode context; infinity when never compute-bound
    ridge_batch_size_short_context: float  # weights only: the ridge as context goes to 0
    concurrency_tpot_s: float
    concurrency_tokens_per_s: float  # output tokens/s across all replicas at the target
    concurrency_regime: str
    concurrency_weight_bytes_read: float  # one step of the users a replica serves
    # Distinct routed experts per layer that step reads (expected, uniform routing); None: dense.
    concurrency_num_experts_read: float | None
    spec_tokens_per_verify: float | None
    spec_speedup: float | None
    spec_tpot_s: float | None
    suggestions: list[Suggestion]

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        for key in ("ridge_batch_size", "ridge_batch_size_short_context"):
            if math.isinf(data[key]):
                data[key] = None  # JSON has no infinity: null means "never compute-bound"
        return data


def make_plan(inputs: PlanInputs, *, with_suggestions: bool = True) -> Plan:
    model, hardware = inputs.model, inputs.hardware
    tp = inputs.tp_size
    dtype = inputs.resolved_compute_dtype
    peak = tp * hardware.peak_flops(dtype)
    bandwidth = tp * hardware.memory_bandwidth
    users_per_replica = math.ceil(inputs.concurrency / inputs.num_replicas)

    weights = formulas.weight_bytes(model, inputs.weight_bits)
    step_weights = formulas.step_weight_bytes(model, inputs.weight_bits)
    expert_weights = formulas.expert_weight_bytes(model, inputs.weight_bits)

    def weights_read(num_tokens: float) -> float:
        return formulas.weight_bytes_read(model, step_weights, expert_weights, num_tokens)

    kv_per_token = formulas.kv_bytes_per_token(model, inputs.kv_bytes_per_element, tp=tp)
    kv_per_sequence = formulas.kv_bytes_per_sequence(model, inputs.kv_bytes_per_element, inputs.context_len,
                                                     tp=tp)
    activations = _activation_bytes(model, dtype)
    overhead = tp * hardware.runtime_overhead_bytes
    memory = tp * hardware.memory_bytes
    usable = memory * (1 - inputs.headroom)
    total = weights + kv_per_sequence * users_per_replica + activations + overhead
    free_for_kv = usable - weights - activations - overhead
    capacity_tokens = formulas.kv_capacity_tokens(free_for_kv, kv_per_token)

    decode_context = float(inputs.context_len)
    if inputs.prompt_len is not None and inputs.output_len is not None:
        decode_context = inputs.prompt_len + inputs.output_len / 2  # mean over the generation
    def kv_read_per_token(context: float) -> float:
        # What a step reads per context token: less than kv_per_token once sliding windows cap layers.
        context = max(1, int(context))
        return formulas.kv_bytes_per_sequence(model, inputs.kv_bytes_per_element, context, tp=tp) / context

    batch1_bytes = formulas.decode_step_bytes(step_weights, kv_read_per_token(inputs.context_len), 1,
                                              inputs.context_len)
    batch1_tpot = formulas.decode_step_seconds(
        formulas.decode_step_flops(model, 1, inputs.context_len), batch1_bytes, peak, bandwidth)
    prompt_len = inputs.prompt_len or inputs.context_len
    prefill_flops = formulas.prefill_flops(model, prompt_len)
    ttft = max(prefill_flops / peak,
               formulas.prefill_bytes(weights_read(prompt_len), kv_read_per_token(prompt_len), prompt_len) / bandwidth)
    step_flops = formulas.decode_step_flops(model, users_per_replica, decode_context)
    step_bytes = formulas.decode_step_bytes(weights_read(users_per_replica), kv_read_per_token(decode_context),
                                            users_per_replica, decode_context)
    step_seconds = formulas.decode_step_seconds(step_flops, step_bytes, peak, bandwidth)

    spec_tokens = spec_speedup = spec_tpot = None
    if inputs.acceptance is not None:
        spec_tokens = formulas.expected_tokens_per_verify(inputs.acceptance,
                                                          inputs.num_speculative_tokens)
        spec_speedup = formulas.speculative_speedup(inputs.acceptance, inputs.num_speculative_tokens,
                                                    inputs.draft_cost)
        spec_tpot = batch1_tpot / spec_speedup

    fits = total <= usable
    plan = Plan(
        compute_dtype=dtype,
        num_replicas=inputs.num_replicas,
        weight_bytes=weights,
        weight_bits=8 * weights / model.num_params,
        num_params=model.num_params,
        num_active_params=model.num_active_params,
        expert_weight_bytes=expert_weights,
        kv_bytes_per_token=kv_per_token,
        kv_bytes_per_sequence=kv_per_sequence,
        kv_bytes_total=kv_per_sequence * users_per_replica,
        activation_bytes=activations,
        runtime_overhead_bytes=overhead,
        total_bytes=total,
        memory_bytes=memory,
        usable_bytes=usable,
        headroom_bytes=usable - total,
        fits=fits,
        max_concurrency=int(max(0.0, free_for_kv) // kv_per_sequence) * inputs.num_replicas,
        max_context_len=_max_context_len(model, inputs.kv_bytes_per_element, tp, free_for_kv, users_per_replica),
        kv_capacity_tokens=capacity_tokens,
        decode_context_len=decode_context,
        batch1_step_bytes=batch1_bytes,
        batch1_weight_bytes_read=step_weights,
        batch1_tpot_s=batch1_tpot,
        batch1_tokens_per_s=1 / batch1_tpot,
        prompt_len=prompt_len,
        prefill_flops=prefill_flops,
        prefill_weight_bytes_read=weights_read(prompt_len),
        ttft_floor_s=ttft,
        ridge_batch_size=formulas.decode_ridge_batch_size(
            model, step_weights, kv_per_token, decode_context, peak, bandwidth, expert_weights=expert_weights),
        ridge_batch_size_short_context=formulas.decode_ridge_batch_size(
            model, step_weights, kv_per_token, 0, peak, bandwidth, expert_weights=expert_weights),
        concurrency_tpot_s=step_seconds,
        concurrency_tokens_per_s=users_per_replica / step_seconds * inputs.num_replicas,
        concurrency_regime="compute-bound" if step_flops / peak > step_bytes / bandwidth
        else "bandwidth-bound",
        concurrency_weight_bytes_read=weights_read(users_per_replica),
        concurrency_num_experts_read=formulas.num_experts_read(model, users_per_replica) if model.is_moe else None,
        spec_tokens_per_verify=spec_tokens,
        spec_speedup=spec_speedup,
        spec_tpot_s=spec_tpot,
        suggestions=[],
    )
    if with_suggestions and not fits:
        plan = dataclasses.replace(plan, suggestions=suggest(inputs, plan))
    return plan


def _max_context_len(model: ModelShape, kv_bytes_per_element: float, tp: int, free_bytes: float, users: int) -> int:
    """The longest context every one of `users` sequences can hold (sliding layers keep only their window)."""
    low, high = 0, model.max_context_len
    while low < high:
        middle = (low + high + 1) // 2
        if users * formulas.kv_bytes_per_sequence(model, kv_bytes_per_element, middle, tp=tp) <= free_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def _activation_bytes(model: ModelShape, compute_dtype: str) -> float:
    """Live activations of one prefill chunk (residual, normed input, q/k/v, attention output,
    gate and up projections: of a mixture of experts, each token's k experts' and the shared
    expert's, and the router's logits) plus fp32 logits for a full batch. Sized for the engine's
    limits, not the target concurrency, so that the capacity figures do not move with the target."""
    element_bytes = 4 if compute_dtype == "fp32" else 2
    if model.is_moe:
        feed_forward = (2 * (model.num_experts_per_token * model.expert_intermediate_size
                             + model.shared_expert_intermediate_size) + model.num_experts)
    else:
        feed_forward = 2 * model.intermediate_size
    width = 3 * model.hidden_size + model.q_size + 2 * model.kv_size + feed_forward
    return MAX_BATCHED_TOKENS * width * element_bytes + MAX_LOGITS_ROWS * model.vocab_size * 4


def suggest(inputs: PlanInputs, plan: Plan) -> list[Suggestion]:
    """Each change that helps, with its number: computed by re-planning, not by rules of thumb."""
    context, users = inputs.context_len, inputs.concurrency
    suggestions = []

    def replan(**changes) -> Plan:
        return make_plan(dataclasses.replace(inputs, **changes), with_suggestions=False)

    def outcome(candidate: Plan) -> str:
        return (f"{candidate.max_concurrency:,} users fit at {context:,} tokens; "
                f"{candidate.max_context_len:,} tokens fit for {users:,} users")

    if plan.max_concurrency >= 1:
        suggestions.append(Suggestion("fewer users", f"at most {plan.max_concurrency:,} users at "
                                      f"{context:,} tokens", False))
    if plan.max_context_len >= 1:
        suggestions.append(Suggestion("shorter context", f"at most {plan.max_context_len:,} tokens "
                                      f"per user for {users:,} users", False))
    if kv_bytes_per_element("int8", inputs.model.head_dim) < inputs.kv_bytes_per_element:
        candidate = replan(kv_dtype="int8")
        kib = candidate.kv_bytes_per_token / 1024
        suggestions.append(Suggestion(f"KV cache in int8 ({kib:,.0f} KiB per token; --kv-cache-dtype int8)",
                                      outcome(candidate), candidate.fits))
    if inputs.model.num_kv_heads > 8:
        candidate = replan(model=dataclasses.replace(inputs.model, num_kv_heads=8))
        kib = candidate.kv_bytes_per_token / 1024
        suggestions.append(Suggestion(f"a GQA model with 8 KV heads ({kib:,.0f} KiB per token)",
                                      outcome(candidate), candidate.fits))
    current_bits = plan.weight_bits
    for bits, label in ((8.0, "8-bit"), (4.5, "4-bit (Q4_K / int4 with scales)")):
        if bits < current_bits - 0.5:
            candidate = replan(weight_bits=bits)
            suggestions.append(Suggestion(f"{label} weights ({candidate.weight_bytes / 1e9:,.1f} GB)",
                                          outcome(candidate), candidate.fits))
            if candidate.fits:
                break
    device_count = _devices_needed(inputs)
    if device_count is not None:
        suggestions.append(Suggestion(
            f"more devices: {device_count} x {inputs.hardware.name} (tensor parallel {device_count})",
            f"fits {users:,} users at {context:,} tokens", True))
    return suggestions


def tensor_parallel_problem(model: ModelShape, tp: int) -> str | None:
    """Why `tp` devices cannot share the model's attention (None: they can). Each device takes
    whole query heads, and either whole KV heads or a copy of one (tp a multiple of them), as
    vLLM splits them."""
    if model.num_heads % tp:
        return f"{tp} does not divide its {model.num_heads} attention heads"
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        return f"{tp} neither divides its {model.num_kv_heads} KV heads nor is a multiple of them"
    return None


def _devices_needed(inputs: PlanInputs, max_devices: int = 64) -> int | None:
    """Fewest devices (one tensor-parallel group the model can be split by) that fit the whole
    target, or None."""
    for count in range(inputs.count + 1, max_devices + 1):
        if tensor_parallel_problem(inputs.model, count) is not None:
            continue
        candidate = dataclasses.replace(inputs, count=count, tp=count)
        if make_plan(candidate, with_suggestions=False).fits:
            return count
    return None
