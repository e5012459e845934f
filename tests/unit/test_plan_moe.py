"""Mixtures of experts in tokios plan, roofline and simulate: all experts resident, a step reads
the dense part and the experts its tokens chose, FLOPs count the active parameters."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from gguf import GGUFWriter

from tests.unit.test_roofline_measure_unit import CONFIG, FakeClock, StandInEngine
from tokios.cli import main as tokios_main
from tokios.model.shape import read_model_shape
from tokios.tools.plan import formulas
from tokios.tools.plan.capacity import PlanInputs, make_plan
from tokios.tools.plan.cli import render_table
from tokios.tools.plan.hardware import NAME_TO_HARDWARE
from tokios.tools.plan.model_presets import NAME_TO_PRESET
from tokios.tools.roofline.measure import engine_footprint, measure_decode_utilization
from tokios.tools.roofline.roofs import decode_regime, Roofs
from tokios.tools.simulate.backend import BackendLimits, ServiceModel
from tokios.tools.simulate.cost_model import BackendCostModel, DecodeRun
from tokios.tools.simulate.engine import FleetSpec, simulate
from tokios.tools.simulate.workload import LengthDistribution, WorkloadSpec, make_workload

QWEN3_MOE = NAME_TO_PRESET["qwen3-30b-a3b"]
H100 = NAME_TO_HARDWARE["h100-sxm"]
Q4_K_BITS = 4.5


# Published totals / active (model cards, billions, to the precision quoted). Ours count every
# matrix and the embedding; gpt-oss's 3.6B active leaves out its embedding table.
@pytest.mark.parametrize("name, total, active, active_without_embedding", [
    ("qwen3-30b-a3b", 30.5, 3.3, False), ("gpt-oss-20b", 20.9, 3.6, True),
    ("mixtral-8x7b", 46.7, 12.9, False), ("olmoe-1b-7b", 6.9, 1.3, False),
])
def test_moe_presets_have_the_published_total_and_active_parameters(name, total, active, active_without_embedding):
    shape = NAME_TO_PRESET[name]
    num_active = shape.num_active_params - (shape.num_embedding_params if active_without_embedding else 0)
    # Measured: 30.53 / 3.353, 20.91 / 3.607, 46.70 / 12.88, 6.919 / 1.282.
    assert shape.num_params / 1e9 == pytest.approx(total, rel=0.005)
    assert num_active / 1e9 == pytest.approx(active, rel=0.02)
    assert shape.is_moe and shape.num_params > 3 * shape.num_active_params


def test_qwen3_moe_preset_bytes_and_flops():
    model = QWEN3_MOE
    routed = 48 * 3 * 2048 * 768 * 128
    assert model.num_routed_expert_params == routed
    assert formulas.weight_bytes(model, 16) == model.num_params * 2  # every expert is resident
    assert formulas.expert_weight_bytes(model, 16) == routed * 2
    one_token = formulas.step_weight_bytes(model, 16)
    assert one_token == model.num_step_params * 2
    norms = (2 * 48 + 1) * 2048
    assert one_token == (model.num_params - routed * 120 // 128 - model.num_embedding_params - norms) * 2
    dense = one_token - routed * 2 * 8 / 128
    for batch_size in (1, 4, 16, 64):
        distinct = 128 * (1 - (1 - 8 / 128) ** batch_size)
        assert formulas.step_weight_bytes(model, 16, batch_size) == pytest.approx(dense + routed * 2 * distinct / 128)
    # A long prompt reads nearly every expert; a batch of 16 about 82 of 128.
    assert formulas.step_weight_bytes(model, 16, 8192) == pytest.approx(formulas.weight_bytes(model, 16)
                                                                        - (model.num_embedding_params + norms) * 2)
    assert formulas.num_experts_read(model, 16) == pytest.approx(82.42, abs=0.01)
    # FLOPs: 2 x active parameters, so at batch 1 in fp16 a step is one FLOP per weight byte, as dense.
    assert formulas.linear_flops_per_token(model) == 2 * model.num_active_layer_linear_params
    assert formulas.decode_step_flops(model, 1, 0) == 2 * model.num_step_params
    assert formulas.decode_step_flops(model, 1, 0) < 0.25 * 2 * model.num_params


def test_expected_distinct_experts_match_uniform_draws():
    """n (1 - (1 - k/n)^B) against B tokens each drawing k of n experts without replacement."""
    model = NAME_TO_PRESET["mixtral-8x7b"]  # 2 of 8
    rng = random.Random(0)
    for batch_size in (1, 2, 3, 8):
        draws = [len(set().union(*(rng.sample(range(8), 2) for _ in range(batch_size)))) for _ in range(20_000)]
        # 20,000 draws: the mean's standard error is under 0.01 experts.
        assert sum(draws) / len(draws) == pytest.approx(formulas.num_experts_read(model, batch_size), abs=0.03)
    assert formulas.num_experts_read(model, 1) == pytest.approx(2)
    assert formulas.num_experts_read(NAME_TO_PRESET["llama-3-8b"], 16) == 0.0


# ---- a tiny Qwen2-MoE GGUF: 2 layers, 4 experts of 16, 2 per token, a shared expert of 32 --------
HIDDEN, VOCAB, NUM_EXPERTS, EXPERT_WIDTH, SHARED_WIDTH = 8, 16, 4, 16, 32


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen2moe.gguf"
    writer = GGUFWriter(str(path), arch="qwen2moe")
    for add, value in ((writer.add_block_count, 2), (writer.add_embedding_length, HIDDEN),
                       (writer.add_feed_forward_length, 64), (writer.add_head_count, 2),
                       (writer.add_head_count_kv, 1), (writer.add_context_length, 128),
                       (writer.add_expert_count, NUM_EXPERTS), (writer.add_expert_used_count, 2),
                       (writer.add_expert_feed_forward_length, EXPERT_WIDTH),
                       (writer.add_expert_shared_feed_forward_length, SHARED_WIDTH)):
        add(value)

    def tensor(name, *shape):
        writer.add_tensor(name, np.ones(shape, dtype=np.float32))

    tensor("token_embd.weight", VOCAB, HIDDEN)
    tensor("output.weight", VOCAB, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    for layer in range(2):
        for name, shape in (("attn_q", (8, 8)), ("attn_k", (4, 8)), ("attn_v", (4, 8)), ("attn_output", (8, 8)),
                            ("attn_norm", (8,)), ("ffn_norm", (8,)), ("ffn_gate_inp", (NUM_EXPERTS, 8)),
                            ("ffn_gate_exps", (NUM_EXPERTS, EXPERT_WIDTH, 8)),
                            ("ffn_up_exps", (NUM_EXPERTS, EXPERT_WIDTH, 8)),
                            ("ffn_down_exps", (NUM_EXPERTS, 8, EXPERT_WIDTH)),
                            ("ffn_gate_shexp", (SHARED_WIDTH, 8)), ("ffn_up_shexp", (SHARED_WIDTH, 8)),
                            ("ffn_down_shexp", (8, SHARED_WIDTH)), ("ffn_gate_inp_shexp", (8,))):
            tensor(f"blk.{layer}.{name}.weight", *shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return read_model_shape(path)


def test_a_moe_gguf_header_gives_the_byte_and_flop_accounting(tiny_moe):
    shape = tiny_moe
    assert (shape.num_experts, shape.num_experts_per_token) == (4, 2)
    assert (shape.expert_intermediate_size, shape.shared_expert_intermediate_size) == (16, 32)
    # float32 tensors: 4 bytes a parameter, every one the shape counts.
    assert shape.file_weight_bytes == 4 * shape.num_params == 4 * 5368
    experts = 2 * 3 * NUM_EXPERTS * EXPERT_WIDTH * HIDDEN * 4
    assert formulas.expert_weight_bytes(shape, None) == experts == 4 * shape.num_routed_expert_params
    # A one-token step: everything but the embedding table and the 2 unchosen experts of 4.
    one_token = 4 * (5368 - VOCAB * HIDDEN) - experts // 2
    assert formulas.step_weight_bytes(shape, None) == one_token == shape.file_step_weight_bytes
    dense = one_token - experts / 2  # attention, router, shared expert, output, norms
    # Two tokens choose 4 (1 - (1 - 2/4)^2) = 3 distinct experts of 4, expected.
    assert formulas.step_weight_bytes(shape, None, 2) == pytest.approx(dense + experts * 3 / 4)
    assert formulas.step_weight_bytes(shape, 8.0, 1) == pytest.approx(shape.num_step_params)  # 8 bits: a byte each
    # Per layer a token multiplies by q, k, v, o (192), 2 experts (768), router (32), shared (768 + 8).
    assert formulas.linear_flops_per_token(shape) == 2 * 2 * (192 + 768 + 32 + 776)
    assert shape.num_active_params == shape.num_params - 2 * 2 * 3 * EXPERT_WIDTH * HIDDEN


def test_plan_of_a_moe_gguf_states_resident_experts_against_the_bytes_read(tiny_moe):
    inputs = PlanInputs(model=tiny_moe, hardware=H100, concurrency=4, context_len=64, prompt_len=32)
    plan = make_plan(inputs)
    assert plan.weight_bytes == tiny_moe.file_weight_bytes
    assert plan.expert_weight_bytes == tiny_moe.file_expert_bytes
    assert plan.batch1_weight_bytes_read == tiny_moe.file_step_weight_bytes
    assert plan.concurrency_num_experts_read == pytest.approx(4 * (1 - 0.5 ** 4))
    assert plan.batch1_weight_bytes_read < plan.concurrency_weight_bytes_read < plan.prefill_weight_bytes_read
    assert (plan.num_params, plan.num_active_params) == (5368, tiny_moe.num_active_params)
    table = render_table(inputs, plan)
    assert re.search(r"^experts\s+4 x 16 wide, 2 per token \+ a shared expert 32 wide: 12.29 KB resident",
                     table, re.MULTILINE)
    assert re.search(r"^weights read\s+.* a step at batch 1 \(2 of 4 experts a layer\); .* at batch 4 "
                     r"\(3.8 expected, uniform routing\); .* for a prefill of 32 tokens$", table, re.MULTILINE)


def test_plan_command_for_a_moe_preset_text_and_json(capsys):
    args = ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h100-sxm", "--weight-bits", "q4_k",
            "--concurrency", "16", "--context", "8192"]
    assert tokios_main(args) == 0
    table = capsys.readouterr().out
    assert "qwen3-30b-a3b: 30.532 B params (3.353 B active per token), 48 layers" in table
    assert re.search(r"^experts\s+128 x 768 wide, 8 per token: 16.31 GB resident, all of them$", table, re.MULTILINE)
    assert re.search(r"^weights read\s+1.71 GB a step at batch 1 \(8 of 128 experts a layer\); 11.19 GB at "
                     r"batch 16 \(82.4 expected, uniform routing\); 17.00 GB for a prefill of 8,192 tokens$",
                     table, re.MULTILINE)
    assert tokios_main([*args, "--json"]) == 0
    output = json.loads(capsys.readouterr().out)
    assert output["inputs"]["num_active_params"] == QWEN3_MOE.num_active_params
    assert (output["inputs"]["num_experts"], output["inputs"]["num_experts_per_token"]) == (128, 8)
    plan = output["plan"]
    assert plan["weight_bytes"] == pytest.approx(QWEN3_MOE.num_params * Q4_K_BITS / 8)
    assert plan["expert_weight_bytes"] == pytest.approx(QWEN3_MOE.num_routed_expert_params * Q4_K_BITS / 8)
    assert plan["batch1_weight_bytes_read"] == pytest.approx(QWEN3_MOE.num_step_params * Q4_K_BITS / 8)
    assert plan["concurrency_num_experts_read"] == pytest.approx(82.42, abs=0.01)
    assert plan["concurrency_tpot_s"] > 4 * plan["batch1_tpot_s"] * 0.9  # 16 users read 82 experts, not 8


def test_dense_plan_has_no_expert_lines():
    inputs = PlanInputs(model=NAME_TO_PRESET["llama-3-8b"], hardware=H100, concurrency=16)
    plan = make_plan(inputs)
    assert plan.expert_weight_bytes == 0 and plan.concurrency_num_experts_read is None
    assert plan.batch1_weight_bytes_read == plan.concurrency_weight_bytes_read == plan.prefill_weight_bytes_read
    table = render_table(inputs, plan)
    assert "experts" not in table and "active" not in table


def test_moe_ridge_balances_compute_and_the_batch_s_weights():
    model, bandwidth, peak = QWEN3_MOE, H100.memory_bandwidth, H100.peak_flops("bf16")
    one_token, experts = formulas.step_weight_bytes(model, 16), formulas.expert_weight_bytes(model, 16)
    ridge = formulas.decode_ridge_batch_size(model, one_token, 0.0, 0, peak, bandwidth, expert_weights=experts)
    compute_s = formulas.decode_step_flops(model, ridge, 0) / peak
    memory_s = formulas.weight_bytes_read(model, one_token, experts, ridge) / bandwidth
    assert compute_s == pytest.approx(memory_s, rel=1e-9)
    # Every expert read before the ridge: far later than if a batch read only k of n.
    assert ridge > 2 * formulas.decode_ridge_batch_size(model, one_token, 0.0, 0, peak, bandwidth)
    roofs = Roofs(bandwidth, peak)
    regimes = [decode_regime(model, roofs, batch_size=b, context_len=0, step_weight_bytes=one_token,
                             kv_bytes_per_token=0.0, expert_weight_bytes=experts).regime
               for b in (int(ridge) - 1, int(ridge) + 1)]
    assert regimes == ["bandwidth-bound", "compute-bound"]


# ---- simulate: a step's cost rises with its batch as the distinct experts grow -------------------
def _moe_cost() -> BackendCostModel:
    return BackendCostModel.from_plan_inputs(PlanInputs(model=QWEN3_MOE, hardware=H100, weight_bits=Q4_K_BITS,
                                                        context_len=4096))


def test_simulated_decode_step_rises_with_the_experts_a_batch_reads():
    cost = _moe_cost()
    batch_sizes = (1, 2, 4, 8, 16, 32, 64)
    steps = [cost.decode_step_seconds(b, 16) for b in batch_sizes]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    kv = cost.kv_bytes_per_token * 16
    for batch_size, seconds in zip(batch_sizes, steps):  # bandwidth-bound: the bytes read over bandwidth
        expected = formulas.step_weight_bytes(QWEN3_MOE, Q4_K_BITS, batch_size) + batch_size * kv
        assert seconds == pytest.approx(expected / cost.memory_bandwidth, rel=1e-12)
    assert steps[4] / steps[0] == pytest.approx(6.6, abs=0.1)  # 82 experts of a layer at batch 16, 8 at batch 1
    plan = make_plan(PlanInputs(model=QWEN3_MOE, hardware=H100, weight_bits=Q4_K_BITS, context_len=4096,
                                concurrency=16), with_suggestions=False)
    assert cost.decode_step_seconds(16, 4096) == pytest.approx(plan.concurrency_tpot_s, rel=1e-12)
    assert cost.prefill_seconds(4096) == pytest.approx(plan.ttft_floor_s, rel=1e-12)
    dense = BackendCostModel.from_plan_inputs(PlanInputs(model=NAME_TO_PRESET["llama-3-8b"], hardware=H100))
    assert dense.weight_bytes_read(1) == dense.weight_bytes_read(64)


def test_a_short_prompt_alone_reads_the_experts_its_tokens_chose():
    """16 prompt tokens are bandwidth-bound: the TTFT floor is the bytes of the experts they chose."""
    cost = _moe_cost()
    weights = formulas.step_weight_bytes(QWEN3_MOE, Q4_K_BITS, 16)
    assert cost.prefill_seconds(16) == pytest.approx((weights + 16 * cost.kv_bytes_per_token) / cost.memory_bandwidth,
                                                     rel=1e-12)
    plan = make_plan(PlanInputs(model=QWEN3_MOE, hardware=H100, weight_bits=Q4_K_BITS, context_len=4096,
                                prompt_len=16), with_suggestions=False)
    assert plan.ttft_floor_s == pytest.approx(cost.prefill_seconds(16), rel=1e-12)
    # The simulated backend's step counts the tokens it carries (its prompt's 16, then 1 a decode).
    lengths = {name: LengthDistribution.parse(value, field_name=name) for name, value in (("p", "16"), ("o", "3"))}
    workload = make_workload(WorkloadSpec(rate=1.0, num_requests=1, prompt_len=lengths["p"], output_len=lengths["o"]))
    limits = BackendLimits(max_num_seqs=8, max_num_batched_tokens=4096)
    request = simulate(workload, FleetSpec(1, ServiceModel.batching(cost, limits)), "rr").requests[0]
    assert request.first_token_s - request.arrival_s == pytest.approx(cost.prefill_seconds(16), rel=1e-9)
    expected = sum(cost.decode_step_seconds(1, 16 + j) for j in (1, 2))
    assert request.finish_s - request.first_token_s == pytest.approx(expected, rel=1e-9)


def test_moe_decode_run_closed_form_equals_its_steps():
    cost = _moe_cost()
    run = DecodeRun(cost, 16, 16 * 100)
    brute = [cost.decode_step_seconds(16, 100 + j) for j in range(50)]
    assert run.elapsed_s(50) == pytest.approx(sum(brute), rel=1e-9)


# ---- roofline: the engine's points read the batch's experts --------------------------------------
MOE_CONFIG = type(CONFIG)(**{**vars(CONFIG), "num_experts": 64, "num_experts_per_token": 8,
                             "expert_intermediate_size": 256, "shared_expert_intermediate_size": 0})


def test_roofline_points_of_a_moe_engine_count_the_experts_each_batch_reads():
    clock = FakeClock()
    engine = StandInEngine(clock)
    engine.model_config = MOE_CONFIG
    footprint = engine_footprint(engine)
    model = footprint.model
    resident = 96_576_768  # the stand-in's weight_bytes(): every expert's included
    assert footprint.expert_weight_bytes == pytest.approx(
        resident * model.num_routed_expert_params / (model.num_layer_linear_params + model.num_embedding_params))
    assert footprint.step_weight_bytes == pytest.approx(resident - footprint.expert_weight_bytes * 56 / 64)
    points = measure_decode_utilization(engine, [1, 4, 16], prompt_len=16, num_steps=(4, 20), clock=clock)
    for point in points:
        weights = footprint.step_weight_bytes + footprint.expert_weight_bytes * (
            formulas.num_experts_read(model, point.batch_size) - 8) / 64
        assert point.bytes_moved == pytest.approx(weights + point.batch_size * 23_040 * 28)
        assert point.flops == formulas.decode_step_flops(model, point.batch_size, 28)
    assert points[0].bytes_moved < points[1].bytes_moved < points[2].bytes_moved
