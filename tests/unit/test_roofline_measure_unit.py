"""measure_prefill/decode_utilization against a stand-in engine with a known cost model.

The stand-in has the offline engine's surface (generate, model_config, weight_bytes,
kv_bytes_per_token) and advances a fake clock by a cost model, so the recovered step times are
checked exactly, with no wall-clock timing in the test.
"""

from __future__ import annotations

import types

import pytest

from tokios.errors import InvalidRequestError, TokiosError
from tokios.outputs import CompletionOutput, RequestOutput
from tokios.tools.plan import formulas
from tokios.tools.roofline.measure import (engine_footprint, measure_decode_utilization,
                                           measure_prefill_utilization)

CONFIG = types.SimpleNamespace(num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9,
                               num_kv_heads=3, head_dim=64, vocab_size=49152)
OVERHEAD_S = 0.3  # per generate call: scheduling, Python
PREFILL_S_PER_TOKEN = 0.002
STEP_BASE_S, STEP_S_PER_REQUEST = 0.010, 0.001


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StandInEngine:
    def __init__(self, clock: FakeClock, *, tokens_short_by: int = 0, has_byte_helpers: bool = True):
        self.model_config = CONFIG
        self.clock = clock
        self.tokens_short_by = tokens_short_by
        self.seen_prompts: list[tuple[int, ...]] = []
        self.dtype = "bfloat16"
        if has_byte_helpers:
            self.weight_bytes = lambda: 96_576_768
            self.kv_bytes_per_token = lambda: 23_040

    def generate(self, prompts, sampling_params):
        assert sampling_params.ignore_eos and sampling_params.temperature == 0
        max_tokens = sampling_params.max_tokens
        self.seen_prompts += [tuple(p) for p in prompts]
        self.clock.now += (OVERHEAD_S + PREFILL_S_PER_TOKEN * sum(len(p) for p in prompts)
                           + (max_tokens - 1) * (STEP_BASE_S + STEP_S_PER_REQUEST * len(prompts)))
        produced = max_tokens - self.tokens_short_by
        return [RequestOutput(str(i), None, list(p), [CompletionOutput(0, token_ids=[7] * produced)],
                              finished=True) for i, p in enumerate(prompts)]


def test_decode_step_time_is_recovered_by_differencing():
    clock = FakeClock()
    engine = StandInEngine(clock)
    points = measure_decode_utilization(engine, [1, 4, 8], prompt_len=16, num_steps=(4, 20), clock=clock)
    footprint = engine_footprint(engine)
    for point, batch_size in zip(points, [1, 4, 8]):
        assert point.phase == "decode" and point.batch_size == batch_size
        assert point.seconds == pytest.approx(STEP_BASE_S + STEP_S_PER_REQUEST * batch_size)
        assert point.context_len == 16 + 12
        assert point.flops == formulas.decode_step_flops(footprint.model, batch_size, 28)
        assert point.bytes_moved == 96_576_768 + batch_size * 23_040 * 28
        assert point.tokens_per_s == pytest.approx(batch_size / point.seconds)


def test_prefill_time_includes_the_single_forward_pass():
    clock = FakeClock()
    engine = StandInEngine(clock)
    points = measure_prefill_utilization(engine, [64, 512], clock=clock)
    assert [p.num_tokens for p in points] == [64, 512]
    assert points[1].seconds == pytest.approx(OVERHEAD_S + PREFILL_S_PER_TOKEN * 512)
    assert points[1].flops == formulas.prefill_flops(engine_footprint(engine).model, 512)


def test_prefill_prompts_are_never_repeated_and_decode_batches_reuse_their_own():
    """A prefill must not find its prompt cached; a decode point's runs reuse one batch,
    prefilled before timing, so that no prefill enters the difference; batch sizes never share."""
    clock = FakeClock()
    engine = StandInEngine(clock)
    measure_prefill_utilization(engine, [8, 8], clock=clock)
    prefill_prompts = list(engine.seen_prompts)
    assert len(set(prefill_prompts)) == len(prefill_prompts)
    measure_decode_utilization(engine, [2, 4], prompt_len=8, clock=clock)
    decode_prompts = engine.seen_prompts[len(prefill_prompts):]
    assert not set(decode_prompts) & set(prefill_prompts)
    assert set(decode_prompts[:2]) & set(decode_prompts[-4:]) == set()  # batch 2's and batch 4's
    assert len(set(decode_prompts)) == 2 + 4
    assert all(min(p) >= 256 for p in engine.seen_prompts)  # no special tokens


def test_a_request_that_stops_early_is_an_error():
    clock = FakeClock()
    with pytest.raises(TokiosError, match="produced"):
        measure_decode_utilization(StandInEngine(clock, tokens_short_by=1), [1], clock=clock)


def test_noise_that_makes_the_difference_negative_is_an_error():
    class StalledShortRuns(StandInEngine):
        def generate(self, prompts, sampling_params):
            if sampling_params.max_tokens == 4:
                self.clock.now += 10.0  # a neighbour stalls every short run
            return super().generate(prompts, sampling_params)

    clock = FakeClock()
    with pytest.raises(TokiosError, match="noisy"):
        measure_decode_utilization(StalledShortRuns(clock), [1], num_steps=(4, 20), clock=clock)


def test_footprint_falls_back_to_the_engine_dtype():
    engine = StandInEngine(FakeClock(), has_byte_helpers=False)
    footprint = engine_footprint(engine)
    assert footprint.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert footprint.step_weight_bytes == footprint.model.num_step_params * 2


@pytest.mark.parametrize("call", [
    lambda e, c: measure_decode_utilization(e, [], clock=c),
    lambda e, c: measure_decode_utilization(e, [1], num_steps=(5, 5), clock=c),
    lambda e, c: measure_prefill_utilization(e, [0], clock=c),
])
def test_bad_sizes_name_the_field(call):
    clock = FakeClock()
    with pytest.raises(InvalidRequestError):
        call(StandInEngine(clock), clock)


def test_one_time_cost_of_a_new_shape_is_kept_out_of_the_timing():
    class ColdShapes(StandInEngine):
        def __init__(self, clock):
            super().__init__(clock)
            self.seen_shapes = set()

        def generate(self, prompts, sampling_params):
            shape = (len(prompts), len(prompts[0]))
            if shape not in self.seen_shapes:
                self.seen_shapes.add(shape)
                self.clock.now += 5.0  # kernel selection for a shape never seen
            return super().generate(prompts, sampling_params)

    clock = FakeClock()
    engine = ColdShapes(clock)
    decode = measure_decode_utilization(engine, [2, 8], prompt_len=16, num_repeats=1, clock=clock)
    prefill = measure_prefill_utilization(engine, [100], num_repeats=1, clock=clock)
    assert [p.seconds for p in decode] == pytest.approx([STEP_BASE_S + 2 * STEP_S_PER_REQUEST,
                                                         STEP_BASE_S + 8 * STEP_S_PER_REQUEST])
    assert prefill[0].seconds == pytest.approx(OVERHEAD_S + PREFILL_S_PER_TOKEN * 100)


def test_a_single_stalled_attempt_is_measured_again():
    class OneStall(StandInEngine):
        has_stalled = False

        def generate(self, prompts, sampling_params):
            if sampling_params.max_tokens == 4 and self.seen_prompts and not self.has_stalled:
                self.has_stalled = True
                self.clock.now += 10.0
            return super().generate(prompts, sampling_params)

    clock = FakeClock()
    engine = OneStall(clock)
    points = measure_decode_utilization(engine, [1], num_steps=(4, 20), num_repeats=1, clock=clock)
    assert engine.has_stalled
    assert points[0].seconds == pytest.approx(STEP_BASE_S + STEP_S_PER_REQUEST)
