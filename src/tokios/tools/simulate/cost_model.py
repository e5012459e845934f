"""What one backend's step costs: the roofline of the batch it runs, through tokios plan's formulas.

Owns `Efficiency` (the share of each roof a real engine reaches, plus a fixed cost per step),
`BackendCostModel` (one backend: a model on a tensor-parallel group of devices, built by
`from_plan_inputs` from tools/plan/capacity.py's `PlanInputs` and `make_plan`) and `DecodeRun` (k decode
steps of an unchanging batch, timed in closed form). Used by backend.py; calibration.py fits
the Efficiency to `tokios roofline` measurements.

A step's time is formulas.decode_step_seconds(FLOPs, bytes, peak, bandwidth), the larger of its
compute time and its memory time, plus `Efficiency.step_overhead_s`. The FLOPs of decode rows and of
prompt tokens are divided by their own efficiency before they are added: a decode row is one row
of each matrix product, a prompt chunk hundreds, and the two can reach different shares of the
FLOP/s roof (fitted on this CPU: 0.19 and 0.24, docs/scale-out.md). The parts of a step:
- every step reads the weights once (formulas.step_weight_bytes), shared by all its rows; of a
  mixture of experts, the dense part and each expert any of its tokens (decode rows and prompt
  tokens together) chose, formulas.weight_bytes_read: more as the step carries more tokens,
  assuming uniform routing (a real router's favourites make batches read somewhat less);
- a decode row adds formulas.decode_step_flops and reads its context's KV
  (formulas.decode_step_bytes);
- a prefill chunk of n tokens after c computed ones adds the layer matrices for n tokens,
  attention of n queries over the c earlier keys and over themselves (causal), and the logits
  when it ends the prompt; it reads the c tokens' KV and writes n (formulas.prefill_bytes).
  A whole prompt in one chunk costs exactly formulas.prefill_flops / prefill_bytes.
So a backend alone with one request has the TTFT floor and the decode TPOT that `tokios plan`
prints (tests/unit/test_simulate.py checks it). Memory for the KV cache is plan's too: what the
devices keep after weights, activations, runtime overhead and headroom.

Not modelled: the tensor-parallel all-reduce (plan counts tp devices' FLOP/s and bandwidth as one),
kernel launch and Python overheads beyond `step_overhead_s`, sampling.
"""

from __future__ import annotations

import dataclasses
import math

from tokios.errors import InvalidRequestError
from tokios.model.shape import ModelShape
from tokios.tools.plan import formulas
from tokios.tools.plan.capacity import PlanInputs, make_plan


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """The share of a roof each kind of work attains (1: the roofline itself): prefill_compute of
    the FLOP/s roof for prompt tokens, decode_compute for decode rows, bandwidth of the memory
    roof; step_overhead_s: what every step costs on top (launches, scheduling, Python)."""

    prefill_compute: float = 1.0
    decode_compute: float = 1.0
    bandwidth: float = 1.0
    step_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for field, value in (("prefill_compute_efficiency", self.prefill_compute),
                             ("decode_compute_efficiency", self.decode_compute),
                             ("bandwidth_efficiency", self.bandwidth)):
            if not (math.isfinite(value) and 0 < value <= 4):
                raise InvalidRequestError(f"{field}: {value!r} must be within (0, 4] (the share of the roof "
                                          "a step attains; 1 is the roofline)", param=field)
        if not (math.isfinite(self.step_overhead_s) and 0 <= self.step_overhead_s <= 10):
            raise InvalidRequestError(f"step_overhead_ms: {self.step_overhead_s * 1e3!r} must be within "
                                      "[0, 10000]", param="step_overhead_ms")

    @property
    def is_roofline(self) -> bool:
        return self == Efficiency()


@dataclasses.dataclass(frozen=True)
class BackendCostModel:
    model: ModelShape
    hardware_name: str
    tp: int
    compute_dtype: str
    step_weight_bytes: float  # what a one-token step reads
    expert_weight_bytes: float  # all routed experts of a mixture of experts (0 dense)
    kv_bytes_per_element: float
    kv_bytes_per_token: float
    peak_flops: float  # FLOP/s of the whole tensor-parallel group, before efficiency
    memory_bandwidth: float  # bytes/s of the group, before efficiency
    kv_capacity_tokens: int
    efficiency: Efficiency = Efficiency()

    @classmethod
    def from_plan_inputs(cls, inputs: PlanInputs, *, efficiency: Efficiency = Efficiency(),
                         kv_cache_bytes: int | None = None) -> "BackendCostModel":
        """One backend = one replica of `inputs` (a tensor-parallel group of inputs.tp_size
        devices). kv_cache_bytes overrides plan's KV memory (as `tokios serve --kv-cache-memory`)."""
        plan = make_plan(inputs, with_suggestions=False)
        tp = inputs.tp_size
        capacity = plan.kv_capacity_tokens if kv_cache_bytes is None else \
            formulas.kv_capacity_tokens(kv_cache_bytes, plan.kv_bytes_per_token)
        if capacity < 1:
            raise InvalidRequestError(
                f"tp: {inputs.model.name} leaves no memory for the KV cache on {tp} x {inputs.hardware.name} "
                f"(weights {plan.weight_bytes / 1e9:,.1f} GB); raise --tp or lower --weight-bits", param="tp")
        return cls(
            model=inputs.model, hardware_name=inputs.hardware.name, tp=tp, compute_dtype=plan.compute_dtype,
            step_weight_bytes=formulas.step_weight_bytes(inputs.model, inputs.weight_bits),
            expert_weight_bytes=formulas.expert_weight_bytes(inputs.model, inputs.weight_bits),
            kv_bytes_per_element=inputs.kv_bytes_per_element, kv_bytes_per_token=plan.kv_bytes_per_token,
            peak_flops=tp * inputs.hardware.peak_flops(plan.compute_dtype),
            memory_bandwidth=tp * inputs.hardware.memory_bandwidth,
            kv_capacity_tokens=capacity, efficiency=efficiency)

    def with_efficiency(self, efficiency: Efficiency) -> "BackendCostModel":
        return dataclasses.replace(self, efficiency=efficiency)

    # ---- the work of a step's parts: (FLOPs, bytes moved besides the weights) ------------------
    def kv_read_per_token(self, context_len: float) -> float:
        """KV bytes per context token a row reads (below kv_bytes_per_token once sliding windows
        cap some layers), as tools/plan/capacity.py counts it."""
        if self.model.layer_windows is None:
            return self.kv_bytes_per_token
        context = max(1, int(context_len))
        return formulas.kv_bytes_per_sequence(self.model, self.kv_bytes_per_element, context,
                                               tp=self.tp) / context

    def decode_work(self, batch_size: int, total_context: float) -> tuple[float, float]:
        """`batch_size` decode rows whose contexts add up to `total_context` tokens."""
        if batch_size == 0:
            return 0.0, 0.0
        mean_context = total_context / batch_size
        return (formulas.decode_step_flops(self.model, batch_size, mean_context),
                formulas.decode_step_bytes(0.0, self.kv_read_per_token(mean_context), batch_size, mean_context))

    def prefill_chunk_work(self, num_tokens: int, num_computed: int, ends_prompt: bool) -> tuple[float, float]:
        """A chunk of `num_tokens` prompt tokens after `num_computed` already in the KV cache."""
        model = self.model
        flops = (formulas.linear_flops_per_token(model) * num_tokens
                 + formulas.attention_flops(model, num_tokens, num_computed, causal=False)
                 + formulas.attention_flops(model, num_tokens, num_tokens, causal=True)
                 + (formulas.logits_flops(model) if ends_prompt else 0.0))
        kv_per_token = self.kv_read_per_token(num_computed + num_tokens)
        num_bytes = formulas.prefill_bytes(0.0, kv_per_token, num_tokens) + kv_per_token * num_computed
        return flops, num_bytes

    # ---- time ------------------------------------------------------------------------------------
    @property
    def effective_bandwidth(self) -> float:
        return self.memory_bandwidth * self.efficiency.bandwidth

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes a step of `num_tokens` tokens reads (formulas.weight_bytes_read)."""
        return formulas.weight_bytes_read(self.model, self.step_weight_bytes, self.expert_weight_bytes, num_tokens)

    def step_seconds(self, decode_flops: float, prefill_flops: float, num_bytes: float, num_tokens: int) -> float:
        """A step of `num_tokens` tokens whose decode rows add up to `decode_flops`, prompt chunks
        to `prefill_flops`, and both to `num_bytes` besides the weights (read once here)."""
        efficiency = self.efficiency
        roofline_flops = decode_flops / efficiency.decode_compute + prefill_flops / efficiency.prefill_compute
        return efficiency.step_overhead_s + formulas.decode_step_seconds(
            roofline_flops, self.weight_bytes_read(num_tokens) + num_bytes, self.peak_flops,
            self.effective_bandwidth)

    def decode_step_seconds(self, batch_size: int, context_len: float) -> float:
        """One step of `batch_size` decode rows, each at `context_len` tokens."""
        flops, num_bytes = self.decode_work(batch_size, batch_size * context_len)
        return self.step_seconds(flops, 0.0, num_bytes, batch_size)

    def prefill_seconds(self, prompt_len: int) -> float:
        """A whole prompt in one step, nothing else in it."""
        flops, num_bytes = self.prefill_chunk_work(prompt_len, 0, True)
        return self.step_seconds(0.0, flops, num_bytes, prompt_len)


class DecodeRun:
    """k decode steps of the same `batch_size` rows: each step every row adds a token, so the
    rows' total context grows by batch_size a step. Compute and memory time are each linear in
    the total context (exactly for full attention; sliding windows make it an approximation),
    so both are lines in the step index j, evaluated through the cost model at j = 0 and 1, and
    the time of k steps is a closed-form sum of the larger line: a run of hundreds of steps is
    one event for the simulator."""

    def __init__(self, cost: BackendCostModel, batch_size: int, total_context: float):
        peak, bandwidth = cost.peak_flops * cost.efficiency.decode_compute, cost.effective_bandwidth
        flops0, bytes0 = cost.decode_work(batch_size, total_context)
        flops1, bytes1 = cost.decode_work(batch_size, total_context + batch_size)
        self.compute0 = flops0 / peak
        self.compute_slope = (flops1 - flops0) / peak
        self.memory0 = (cost.weight_bytes_read(batch_size) + bytes0) / bandwidth
        self.memory_slope = (bytes1 - bytes0) / bandwidth
        self.overhead_s = cost.efficiency.step_overhead_s

    def step_seconds(self, step_index: int) -> float:
        return self.overhead_s + max(self.compute0 + self.compute_slope * step_index,
                                     self.memory0 + self.memory_slope * step_index)

    def elapsed_s(self, num_steps: int) -> float:
        """Time of steps 0 .. num_steps - 1."""
        if num_steps <= 0:
            return 0.0
        gap0 = self.compute0 - self.memory0  # > 0 where compute is the larger
        gap_slope = self.compute_slope - self.memory_slope
        if gap_slope == 0:
            split = num_steps if gap0 > 0 else 0  # all compute, or all memory
            compute_first = True
        else:
            root = -gap0 / gap_slope
            split = min(max(math.ceil(root), 0), num_steps)
            compute_first = gap_slope < 0  # the gap falls: compute leads before the crossing
        if compute_first:
            total = (_sum_of_line(self.compute0, self.compute_slope, 0, split)
                     + _sum_of_line(self.memory0, self.memory_slope, split, num_steps))
        else:
            total = (_sum_of_line(self.memory0, self.memory_slope, 0, split)
                     + _sum_of_line(self.compute0, self.compute_slope, split, num_steps))
        return total + self.overhead_s * num_steps

    def steps_done_by(self, elapsed_s: float, max_steps: int) -> int:
        """The number of whole steps finished `elapsed_s` after the run started (at most max_steps)."""
        low, high = 0, max_steps
        while low < high:
            middle = (low + high + 1) // 2
            if self.elapsed_s(middle) <= elapsed_s:
                low = middle
            else:
                high = middle - 1
        return low


def _sum_of_line(intercept: float, slope: float, start: int, stop: int) -> float:
    """sum of intercept + slope * j for j in [start, stop)."""
    count = stop - start
    if count <= 0:
        return 0.0
    return count * intercept + slope * count * (start + stop - 1) / 2
