"""Measured prefill and decode steps of a live engine, as roofline points.

Owns `measure_prefill_utilization(engine, prompt_lens)` and
`measure_decode_utilization(engine, batch_sizes)`, which drive the offline engine
(`tokios.engine.LLM`: `generate(prompts, sampling_params)`, `model_config`, `weight_bytes()`,
`kv_bytes_per_token()`) and return RooflinePoint values (roofs.py): FLOPs and bytes from
the model's shapes (tools/plan/formulas.py), seconds from the wall clock. tools/roofline/cli.py
prints them against the roofs; `point.summary(roofs)` gives the utilization from Python.

The weight bytes a step reads come from one place, `EngineFootprint.weight_bytes_read(num_tokens)`:
an estimate from the engine's weight bytes and the model's shapes (a mixture of experts: the
dense part and the experts its tokens are expected to choose under uniform routing). A bytes
figure the engine measures (what its kernels touched per step) replaces that method's estimate,
and every point's bytes and read-roof share follow.

How a step is isolated (why): a prefill is a request with max_tokens=1 (one forward pass over
the prompt, then one sampled token). A decode step is the difference of two runs of the same
batch shape with different max_tokens and ignore_eos, divided by the difference in steps, so
that prefill, scheduling and warm-up cancel out. A prefill run uses fresh random prompts (a reused
prompt would hit the prefix cache and make its prefill free); the decode runs reuse one batch of
prompts, prefilled once before timing, so that both runs find them cached and no prefill's noise
enters the difference.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Callable, Sequence

from tokios.errors import InvalidRequestError, TokiosError
from tokios.model.shape import ModelShape
from tokios.tools.plan import formulas
from tokios.tools.roofline.roofs import RooflinePoint

_DTYPE_TO_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                   "int8": 1, "fp8": 1}
_MAX_DECODE_ATTEMPTS = 3
_FIRST_ORDINARY_TOKEN_ID = 256  # below this, vocabularies keep their special tokens


@dataclasses.dataclass(frozen=True)
class EngineFootprint:
    """What one step of this engine reads: its shapes and the bytes of weights and KV."""

    model: ModelShape
    step_weight_bytes: float  # what a one-token step reads
    kv_bytes_per_token: float
    expert_weight_bytes: float = 0.0  # a mixture of experts: every routed expert, all resident

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes a step of `num_tokens` tokens reads (formulas.weight_bytes_read)."""
        return formulas.weight_bytes_read(self.model, self.step_weight_bytes, self.expert_weight_bytes, num_tokens)


def engine_footprint(engine: Any) -> EngineFootprint:
    config = engine.model_config
    model = ModelShape(
        name=str(getattr(config, "name", "engine model")),
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
        max_context_len=int(getattr(config, "max_context_len", 0) or getattr(config, "max_model_len", 0)
                            or 1 << 30),
        # Unknown tying counts the embedding as read: an upper bound on bytes, never an excuse.
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        num_experts=getattr(config, "num_experts", 0), num_experts_per_token=getattr(config, "num_experts_per_token", 0),
        expert_intermediate_size=getattr(config, "expert_intermediate_size", 0),
        shared_expert_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0),
    )
    if hasattr(engine, "weight_bytes"):
        # The engine counts its linear layers, every expert's included, and output projection
        # (not the embedding table, which a step only gathers rows of): what a dense step reads.
        # Of a mixture of experts the routed experts' share is estimated by their parameters'.
        resident = float(engine.weight_bytes())
        expert_weights = resident * model.num_routed_expert_params / (model.num_layer_linear_params
                                                                      + model.num_embedding_params)
        step_weights = resident - expert_weights * (1 - model.num_experts_per_token / model.num_experts) \
            if model.is_moe else resident
    else:
        step_weights = model.num_step_params * _engine_dtype_bytes(engine, config)
        expert_weights = model.num_routed_expert_params * _engine_dtype_bytes(engine, config)
    if hasattr(engine, "kv_bytes_per_token"):
        kv_per_token = float(engine.kv_bytes_per_token())
    else:
        kv_per_token = formulas.kv_bytes_per_token(model, _engine_dtype_bytes(engine, config))
    return EngineFootprint(model, step_weights, kv_per_token, expert_weights)


def _engine_dtype_bytes(engine: Any, config: Any) -> int:
    dtype = str(getattr(engine, "dtype", None) or getattr(config, "dtype", "")).removeprefix("torch.")
    if dtype not in _DTYPE_TO_BYTES:
        raise TokiosError(f"roofline: the engine exposes neither weight_bytes() nor a known dtype "
                          f"(got {dtype!r}); cannot size the bytes a step reads")
    return _DTYPE_TO_BYTES[dtype]


class _PromptMaker:
    """Fresh random token-id prompts, so no run ever hits the prefix cache of an earlier one."""

    def __init__(self, vocab_size: int, seed: int):
        self.low = _FIRST_ORDINARY_TOKEN_ID if vocab_size > 2 * _FIRST_ORDINARY_TOKEN_ID else 0
        self.high = vocab_size - 1
        self.rng = random.Random(seed)

    def make(self, num_prompts: int, prompt_len: int) -> list[list[int]]:
        return [[self.rng.randint(self.low, self.high) for _ in range(prompt_len)]
                for _ in range(num_prompts)]


Clock = Callable[[], float]


def _weight_bytes_read(engine: Any) -> int | None:
    """The weight bytes the engine's kernels have counted reading so far (None: it does not count)."""
    counter = getattr(engine, "weight_bytes_read", None)
    return counter() if counter is not None else None


def _counted_generate(engine: Any, prompts: list[list[int]], max_tokens: int, clock: Clock) -> tuple[float, int | None]:
    """(seconds, weight bytes the kernels counted) of one run."""
    before = _weight_bytes_read(engine)
    seconds = _timed_generate(engine, prompts, max_tokens, clock)
    after = _weight_bytes_read(engine)
    return seconds, None if before is None or after is None else after - before


def _timed_generate(engine: Any, prompts: list[list[int]], max_tokens: int, clock: Clock) -> float:
    from tokios.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = clock()
    outputs = engine.generate(prompts, params)
    seconds = clock() - start
    for output in outputs:
        produced = len(output.outputs[0].token_ids)
        if produced != max_tokens:
            raise TokiosError(f"roofline: a request produced {produced} tokens instead of "
                              f"{max_tokens} (ignore_eos=True); the step count would be wrong")
    return seconds


def _check_sizes(field: str, values: Sequence[int]) -> None:
    if not values or any(not isinstance(v, int) or v < 1 for v in values):
        raise InvalidRequestError(f"{field}: {list(values)!r} must be a non-empty list of integers "
                                  ">= 1", param=field)


def measure_prefill_utilization(engine: Any, prompt_lens: Sequence[int], *, num_repeats: int = 2,
                                seed: int = 0, clock: Clock = time.perf_counter) -> list[RooflinePoint]:
    """One point per prompt length: the best of `num_repeats` single-request prefills."""
    _check_sizes("prompt_lens", prompt_lens)
    footprint = engine_footprint(engine)
    prompts = _PromptMaker(footprint.model.vocab_size, seed)
    points = []
    for prompt_len in prompt_lens:
        # Untimed first: a new shape can cost one-time work (kernel selection, allocation).
        _timed_generate(engine, prompts.make(1, prompt_len), 1, clock)
        seconds = min(_timed_generate(engine, prompts.make(1, prompt_len), 1, clock)
                      for _ in range(num_repeats))
        points.append(RooflinePoint(
            phase="prefill", batch_size=1, num_tokens=prompt_len, context_len=prompt_len,
            flops=formulas.prefill_flops(footprint.model, prompt_len),
            bytes_moved=formulas.prefill_bytes(footprint.weight_bytes_read(prompt_len),
                                               footprint.kv_bytes_per_token, prompt_len),
            seconds=seconds))
    return points


def measure_decode_utilization(engine: Any, batch_sizes: Sequence[int], *, prompt_len: int = 32,
                               num_steps: tuple[int, int] = (4, 20), num_repeats: int = 2,
                               seed: int = 1, clock: Clock = time.perf_counter) -> list[RooflinePoint]:
    """One point per batch size: the time of one decode step of `batch_size` requests, from
    the difference between runs of `num_steps[0]` and `num_steps[1]` output tokens."""
    _check_sizes("batch_sizes", batch_sizes)
    short_steps, long_steps = num_steps
    if not 1 <= short_steps < long_steps:
        raise InvalidRequestError(f"num_steps: {num_steps!r} must be (short, long) with "
                                  "1 <= short < long", param="num_steps")
    footprint = engine_footprint(engine)
    prompts = _PromptMaker(footprint.model.vocab_size, seed)
    # The differenced steps see contexts from prompt_len + short_steps to prompt_len + long_steps.
    context_len = prompt_len + (short_steps + long_steps) / 2
    points = []
    for batch_size in batch_sizes:
        # The same prompts for every timed run, prefilled once untimed (which also pays a new
        # batch shape's one-time work): the timed runs find them in the prefix cache, so the
        # long-minus-short difference is decode alone. With fresh prompts each run carried a
        # whole prefill, whose noise at 4,000 tokens (a few seconds, +-10%) buried 16 steps.
        batch_prompts = prompts.make(batch_size, prompt_len)
        _timed_generate(engine, batch_prompts, short_steps, clock)
        # A neighbour's burst can make the short runs slower than the long ones; measure again
        # a few times before calling the machine too noisy.
        for _ in range(_MAX_DECODE_ATTEMPTS):
            short = [_counted_generate(engine, batch_prompts, short_steps, clock) for _ in range(num_repeats)]
            long = [_counted_generate(engine, batch_prompts, long_steps, clock) for _ in range(num_repeats)]
            short_s, long_s = min(s for s, _ in short), min(s for s, _ in long)
            step_seconds = (long_s - short_s) / (long_steps - short_steps)
            if step_seconds > 0:
                break
        if step_seconds <= 0:
            raise TokiosError(f"roofline: decode at batch {batch_size} timed {long_s:.3f} s for "
                              f"{long_steps} steps but {short_s:.3f} s for {short_steps}; the "
                              "machine is too noisy, raise num_repeats or the step counts")
        # The same difference of counted bytes leaves a decode step's own (greedy runs of the
        # same prompts choose the same experts every time).
        counted = None if short[0][1] is None else (long[0][1] - short[0][1]) / (long_steps - short_steps)
        estimated = footprint.weight_bytes_read(batch_size)
        points.append(RooflinePoint(
            phase="decode", batch_size=batch_size, num_tokens=batch_size, context_len=context_len,
            flops=formulas.decode_step_flops(footprint.model, batch_size, context_len),
            bytes_moved=formulas.decode_step_bytes(estimated if counted is None else counted,
                                                   footprint.kv_bytes_per_token, batch_size,
                                                   context_len),
            seconds=step_seconds, weight_bytes_counted=counted, weight_bytes_estimated=estimated))
    return points
