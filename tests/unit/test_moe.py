"""The sparse MoE layer (model/moe.py): parity with transformers' own sparse MoE blocks, and the
mechanics of routing and of running only the chosen experts.

Parity: each transformers block is built from its config class with tiny sizes and seeded
random weights (float32), the weights copied into a SparseMoE as the GGUF converter would lay
them out, and both run on the same rows. Mapping (transformers -> ours):
- Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE: gate.weight -> router_weight; experts.gate_up_proj
  [E, 2I, H] -> gate = [:, :I], up = [:, I:]; experts.down_proj [E, H, I] -> down.
  Qwen2-MoE: shared_expert.{gate,up,down}_proj.weight -> SharedExpert.{gate,up,down};
  shared_expert_gate.weight [1, H] -> SharedExpert.output_gate.
- gpt-oss: router.weight, router.bias -> router_weight, router_bias; experts.gate_up_proj
  [E, H, 2I] has gate and up interleaved in its last dimension: gate = [..., ::2] and
  up = [..., 1::2], transposed to [E, I, H]; gate_up_proj_bias the same way -> gate_bias,
  up_bias; down_proj [E, I, H] transposed -> down; down_proj_bias -> down_bias.
Measured (transformers 5.25, torch 2.13, CPU): outputs agree exactly at 1 row; at 23 rows the
largest difference is 3.8e-6 on outputs up to 17 (gpt-oss: 1.8e-7 on outputs up to 1.3), at 200
rows 7.6e-6 on outputs up to 38: about 2e-7 relative, float32 summation order. Asserted at
|ours - theirs| <= 1e-5 + 1e-6 |theirs|.

Equal router scores pick the lower expert id first (route's stable sort); the tests build
exact ties and check it, for every scoring, also at 128 experts.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
import torch.nn.functional as F

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model import moe
from tokios.model.moe import ExpertActivation, Routing, SharedExpert, SparseMoE, route

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 16, 8, 8, 2


def _randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def _fused_experts(block, routing: Routing, shared_expert: SharedExpert | None = None) -> SparseMoE:
    gate_up = block.experts.gate_up_proj.detach()
    intermediate = gate_up.shape[1] // 2
    return SparseMoE(routing, block.gate.weight.detach(), gate_up[:, :intermediate], gate_up[:, intermediate:],
                     block.experts.down_proj.detach(), shared_expert=shared_expert)


def _transformers_block(model_type: str, config_class: str, block_class: str, seed: int, **config_fields):
    """transformers' own MoE block of `model_type` (eager experts), its weights drawn from `seed`."""
    import importlib

    import transformers

    config = getattr(transformers, config_class)(hidden_size=HIDDEN, num_experts_per_tok=TOP_K, **config_fields)
    config._experts_implementation = "eager"
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    block = getattr(modeling, block_class)(config)
    _randomize(block, seed)
    return block, config


def _qwen3_moe(norm_topk_prob: bool):
    block, _ = _transformers_block("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeSparseMoeBlock", 1,
                                   moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
                                   norm_topk_prob=norm_topk_prob)
    return block, _fused_experts(block, Routing(NUM_EXPERTS, TOP_K, normalize_top_k=norm_topk_prob))


def _qwen2_moe():
    block, _ = _transformers_block("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeSparseMoeBlock", 2,
                                   moe_intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS,
                                   norm_topk_prob=False, shared_expert_intermediate_size=12)
    shared = block.shared_expert
    shared_expert = SharedExpert(shared.gate_proj.weight.detach(), shared.up_proj.weight.detach(),
                                 shared.down_proj.weight.detach(), block.shared_expert_gate.weight.detach())
    return block, _fused_experts(block, Routing(NUM_EXPERTS, TOP_K), shared_expert)


def _mixtral():
    block, _ = _transformers_block("mixtral", "MixtralConfig", "MixtralSparseMoeBlock", 3,
                                   intermediate_size=INTERMEDIATE, num_local_experts=NUM_EXPERTS)
    return block, _fused_experts(block, Routing(NUM_EXPERTS, TOP_K, normalize_top_k=True))


def _olmoe():
    block, _ = _transformers_block("olmoe", "OlmoeConfig", "OlmoeSparseMoeBlock", 4,
                                   intermediate_size=INTERMEDIATE, num_experts=NUM_EXPERTS, norm_topk_prob=False)
    return block, _fused_experts(block, Routing(NUM_EXPERTS, TOP_K))


def _gpt_oss():
    # A limit of 0.5 against weights of std 0.5 makes both clamps bite on these rows.
    block, config = _transformers_block("gpt_oss", "GptOssConfig", "GptOssMLP", 5, intermediate_size=INTERMEDIATE,
                                        num_local_experts=NUM_EXPERTS, swiglu_limit=0.5)
    experts = block.experts
    gate_up = experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
    gate_up_bias = experts.gate_up_proj_bias.detach()
    layer = SparseMoE(Routing(NUM_EXPERTS, TOP_K, scoring="top_k_softmax"), block.router.weight.detach(),
                      gate_up[:, ::2], gate_up[:, 1::2], experts.down_proj.detach().transpose(1, 2),
                      activation=ExpertActivation("swiglu_oai", alpha=config.swiglu_alpha, limit=config.swiglu_limit),
                      router_bias=block.router.bias.detach(), gate_bias=gate_up_bias[:, ::2],
                      up_bias=gate_up_bias[:, 1::2], down_bias=experts.down_proj_bias.detach())

    class Block(torch.nn.Module):
        def forward(self, hidden):  # GptOssMLP also returns its router scores
            return block(hidden)[0]

    return Block(), layer


BUILDERS = {
    "qwen3_moe": lambda: _qwen3_moe(norm_topk_prob=True),
    "qwen3_moe_unnormalized": lambda: _qwen3_moe(norm_topk_prob=False),
    "qwen2_moe_shared_expert": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
}


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize("num_rows", [1, 23])
def test_parity_with_transformers(name, num_rows):
    block, layer = BUILDERS[name]()
    hidden = torch.randn(1, num_rows, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = block(hidden).reshape(num_rows, HIDDEN)
        actual = layer(hidden.reshape(num_rows, HIDDEN))
    assert actual.shape == (num_rows, HIDDEN)
    assert expected.abs().max() > 0.1  # the comparison is not between two near-zero outputs
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-6)


def test_gpt_oss_case_clamps():
    """The gpt-oss parity case reaches both clamps of its activation (else it would not test them)."""
    _, layer = _gpt_oss()
    hidden = torch.randn(23, HIDDEN, generator=torch.Generator().manual_seed(7))
    gate = torch.einsum("rh,eih->rei", hidden, layer.gate) + layer.gate_bias
    up = torch.einsum("rh,eih->rei", hidden, layer.up) + layer.up_bias
    limit = layer.activation.limit
    assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()


# -- mechanics, on a hand-built layer against a row-by-row dense reference ------------------------

def _layer(seed: int = 0, num_experts: int = NUM_EXPERTS, top_k: int = TOP_K, **kwargs) -> SparseMoE:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator) * 0.5

    routing = kwargs.pop("routing", None) or Routing(num_experts, top_k, normalize_top_k=True)
    return SparseMoE(routing, randn(num_experts, HIDDEN), randn(num_experts, INTERMEDIATE, HIDDEN),
                     randn(num_experts, INTERMEDIATE, HIDDEN), randn(num_experts, HIDDEN, INTERMEDIATE), **kwargs)


def _reference(layer: SparseMoE, hidden: torch.Tensor) -> torch.Tensor:
    """Each row through its own k experts, one at a time, weighted (no grouping)."""
    expert_ids, weights = route(F.linear(hidden, layer.router_weight, layer.router_bias), layer.routing,
                                layer.selection_bias)
    output = torch.zeros_like(hidden)
    for row in range(hidden.shape[0]):
        for slot in range(expert_ids.shape[1]):
            expert_id = int(expert_ids[row, slot])
            x = hidden[row]
            gate = layer.gate[expert_id] @ x
            up = layer.up[expert_id] @ x
            if layer.gate_bias is not None:
                gate, up = gate + layer.gate_bias[expert_id], up + layer.up_bias[expert_id]
            down = layer.down[expert_id] @ layer.activation(gate, up)
            if layer.down_bias is not None:
                down = down + layer.down_bias[expert_id]
            output[row] += weights[row, slot] * down
    return output


def _hidden(num_rows: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(num_rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh", "swiglu_oai"])
def test_grouped_equals_row_by_row_reference(kind):
    layer = _layer(activation=ExpertActivation(kind, limit=0.5))
    hidden = _hidden(37)
    torch.testing.assert_close(layer(hidden), _reference(layer, hidden), atol=1e-5, rtol=1e-5)


def test_activation_formulas():
    generator = torch.Generator().manual_seed(12)
    gate, up = torch.randn(50, generator=generator) * 3, torch.randn(50, generator=generator) * 3
    torch.testing.assert_close(ExpertActivation("silu")(gate, up), gate / (1 + torch.exp(-gate)) * up)
    tanh_gelu = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    torch.testing.assert_close(ExpertActivation("gelu_tanh")(gate, up), tanh_gelu * up)
    clamped_gate, clamped_up = gate.clamp(max=2.0), up.clamp(-2.0, 2.0)
    torch.testing.assert_close(ExpertActivation("swiglu_oai", alpha=1.5, limit=2.0)(gate, up),
                               clamped_gate / (1 + torch.exp(-1.5 * clamped_gate)) * (clamped_up + 1))


def test_expert_biases_and_router_bias_are_applied():
    generator = torch.Generator().manual_seed(11)
    biases = dict(router_bias=torch.randn(NUM_EXPERTS, generator=generator),
                  gate_bias=torch.randn(NUM_EXPERTS, INTERMEDIATE, generator=generator),
                  up_bias=torch.randn(NUM_EXPERTS, INTERMEDIATE, generator=generator),
                  down_bias=torch.randn(NUM_EXPERTS, HIDDEN, generator=generator))
    layer = _layer(**biases)
    hidden = _hidden(9)
    torch.testing.assert_close(layer(hidden), _reference(layer, hidden), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(layer(hidden), _layer()(hidden), atol=1e-3)


class _CountingFunctional:
    """Stands in for torch.nn.functional inside model/moe.py and counts, per weight tensor's
    address, how many products read it."""

    def __init__(self):
        self.reads = collections.Counter()

    def linear(self, x, weight, bias=None):
        self.reads[weight.data_ptr()] += 1
        return F.linear(x, weight, bias)

    def __getattr__(self, name):
        return getattr(F, name)


def _expert_reads(layer: SparseMoE, counting: _CountingFunctional) -> dict[int, tuple[int, int, int]]:
    """expert id -> how many products read its (gate, up, down) matrices."""
    return {expert_id: tuple(counting.reads[tensor[expert_id].data_ptr()]
                             for tensor in (layer.gate, layer.up, layer.down))
            for expert_id in range(layer.routing.num_experts)}


def _biased_towards(expert_ids: list[int], top_k: int, num_experts: int = NUM_EXPERTS) -> SparseMoE:
    """A layer whose router bias makes every row choose expert_ids, in that order."""
    router_bias = torch.zeros(num_experts)
    for rank, expert_id in enumerate(expert_ids):
        router_bias[expert_id] = 100.0 - 10 * rank
    return _layer(num_experts=num_experts, top_k=top_k, router_bias=router_bias)


@pytest.mark.parametrize("top_k, chosen", [(1, [5]), (2, [5, 2])])
def test_all_rows_choose_the_same_experts(monkeypatch, top_k, chosen):
    layer = _biased_towards(chosen, top_k)
    hidden = _hidden(19)
    expert_ids, _ = route(F.linear(hidden, layer.router_weight, layer.router_bias), layer.routing)
    assert expert_ids.tolist() == [chosen] * 19
    counting = _CountingFunctional()
    monkeypatch.setattr(moe, "F", counting)
    output = layer(hidden)
    monkeypatch.undo()
    torch.testing.assert_close(output, _reference(layer, hidden), atol=1e-5, rtol=1e-5)
    # Each chosen expert's three matrices are read by one product each, whatever the row count.
    assert _expert_reads(layer, counting) == {e: (1, 1, 1) if e in chosen else (0, 0, 0) for e in range(NUM_EXPERTS)}


def test_each_chosen_expert_is_read_once_per_call(monkeypatch):
    layer = _layer()
    hidden = _hidden(41)
    expert_ids, _ = route(F.linear(hidden, layer.router_weight), layer.routing)
    chosen = set(expert_ids.flatten().tolist())
    counting = _CountingFunctional()
    monkeypatch.setattr(moe, "F", counting)
    layer(hidden)
    monkeypatch.undo()
    assert _expert_reads(layer, counting) == {e: (1, 1, 1) if e in chosen else (0, 0, 0) for e in range(NUM_EXPERTS)}


def test_an_expert_no_row_chooses_is_never_read():
    """Expert 7's weights are NaN and no row chooses it: the output stays finite and equals that
    of the same layer with expert 7 zeroed."""
    layer = _layer()
    router_bias = torch.zeros(NUM_EXPERTS)
    router_bias[7] = -100.0
    zeroed, poisoned = (SparseMoE(layer.routing, layer.router_weight, layer.gate.clone(), layer.up.clone(),
                                  layer.down.clone(), router_bias=router_bias) for _ in range(2))
    for tensor in (zeroed.gate, zeroed.up, zeroed.down):
        tensor[7] = 0.0
    for tensor in (poisoned.gate, poisoned.up, poisoned.down):
        tensor[7] = math.nan
    hidden = _hidden(29)
    expert_ids, _ = route(F.linear(hidden, poisoned.router_weight, poisoned.router_bias), poisoned.routing)
    assert 7 not in expert_ids.tolist() and len(set(expert_ids.flatten().tolist())) > 2
    output = poisoned(hidden)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output, zeroed(hidden), atol=0, rtol=0)


def test_shared_expert_on_and_off():
    generator = torch.Generator().manual_seed(5)
    gate, up = torch.randn(12, HIDDEN, generator=generator), torch.randn(12, HIDDEN, generator=generator)
    down, output_gate = torch.randn(HIDDEN, 12, generator=generator), torch.randn(HIDDEN, generator=generator)
    hidden = _hidden(13)
    routed = _layer()(hidden)
    shared = F.linear(F.silu(F.linear(hidden, gate)) * F.linear(hidden, up), down)
    ungated = _layer(shared_expert=SharedExpert(gate, up, down))(hidden)
    torch.testing.assert_close(ungated, routed + shared, atol=1e-5, rtol=1e-5)
    gated = _layer(shared_expert=SharedExpert(gate, up, down, output_gate.reshape(1, HIDDEN)))(hidden)
    torch.testing.assert_close(gated, routed + torch.sigmoid(hidden @ output_gate)[:, None] * shared,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_shared_expert", [False, True])
def test_one_row_and_no_rows(with_shared_expert):
    generator = torch.Generator().manual_seed(6)
    shared_expert = SharedExpert(torch.randn(12, HIDDEN, generator=generator),
                                 torch.randn(12, HIDDEN, generator=generator),
                                 torch.randn(HIDDEN, 12, generator=generator),
                                 torch.randn(HIDDEN, generator=generator))
    layer = _layer(shared_expert=shared_expert if with_shared_expert else None)
    hidden = _hidden(5)
    full = layer(hidden)
    one = layer(hidden[2:3])
    assert one.shape == (1, HIDDEN)
    torch.testing.assert_close(one, full[2:3], atol=1e-5, rtol=1e-5)
    none = layer(hidden[:0])
    assert none.shape == (0, HIDDEN) and none.dtype == hidden.dtype


# -- routing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "top_k_softmax"])
def test_equal_scores_choose_the_lower_expert_id_first(scoring):
    logits = torch.tensor([[0.0] * 8,
                           [0.0, 2.0, 1.0, 2.0, 2.0, 0.0, 0.0, 0.0],
                           [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    expert_ids, weights = route(logits, Routing(8, 2, scoring=scoring))
    assert expert_ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert expert_ids.tolist() == [[0, 1], [1, 3], [0, 7]]
    assert (weights[:, 0] == weights[:, 1]).all()
    # 128 experts (where sort algorithms change): all equal, and three equal leaders out of order.
    wide = torch.zeros(2, 128)
    wide[1, [120, 5, 64]] = 1.0
    expert_ids, _ = route(wide, Routing(128, 8, scoring=scoring))
    assert expert_ids[0].tolist() == list(range(8))
    assert expert_ids[1].tolist() == [5, 64, 120, 0, 1, 2, 3, 4]


def test_softmax_top_k_with_and_without_renormalisation():
    logits = torch.randn(6, NUM_EXPERTS, generator=torch.Generator().manual_seed(8))
    probabilities = torch.softmax(logits, dim=-1)
    expected_weights, expected_ids = torch.sort(probabilities, dim=-1, descending=True)
    expected_ids, expected_weights = expected_ids[:, :3], expected_weights[:, :3]
    expert_ids, weights = route(logits, Routing(NUM_EXPERTS, 3))
    assert expert_ids.tolist() == expected_ids.tolist()
    torch.testing.assert_close(weights, expected_weights)
    assert (weights.sum(dim=-1) < 1).all()
    _, normalized = route(logits, Routing(NUM_EXPERTS, 3, normalize_top_k=True))
    torch.testing.assert_close(normalized, expected_weights / expected_weights.sum(dim=-1, keepdim=True))
    _, scaled = route(logits, Routing(NUM_EXPERTS, 3, normalize_top_k=True, scale=2.5))
    torch.testing.assert_close(scaled, 2.5 * normalized)


def test_sigmoid_and_top_k_softmax_scoring():
    logits = torch.randn(6, NUM_EXPERTS, generator=torch.Generator().manual_seed(9))
    top_logits, top_ids = torch.sort(logits, dim=-1, descending=True)
    top_logits, top_ids = top_logits[:, :2], top_ids[:, :2]
    expert_ids, weights = route(logits, Routing(NUM_EXPERTS, 2, scoring="sigmoid"))
    assert expert_ids.tolist() == top_ids.tolist()
    torch.testing.assert_close(weights, torch.sigmoid(top_logits))
    expert_ids, weights = route(logits, Routing(NUM_EXPERTS, 2, scoring="top_k_softmax"))
    assert expert_ids.tolist() == top_ids.tolist()
    torch.testing.assert_close(weights, torch.softmax(top_logits, dim=-1))


def test_sigmoid_renormalisation_of_underflowed_scores_stays_finite():
    _, weights = route(torch.full((1, 4), -200.0), Routing(4, 2, scoring="sigmoid", normalize_top_k=True))
    assert torch.isfinite(weights).all()


def test_selection_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    routing = Routing(4, 2, scoring="sigmoid")
    expert_ids, weights = route(logits, routing, selection_bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert expert_ids.tolist() == [[3, 0]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


def test_route_of_no_rows():
    expert_ids, weights = route(torch.zeros(0, NUM_EXPERTS), Routing(NUM_EXPERTS, TOP_K, normalize_top_k=True))
    assert expert_ids.shape == (0, TOP_K) and weights.shape == (0, TOP_K)


@pytest.mark.parametrize("fields, param", [
    (dict(num_experts=0, num_experts_per_token=1), "num_experts"),
    (dict(num_experts=4, num_experts_per_token=5), "num_experts_per_token"),
    (dict(num_experts=4, num_experts_per_token=0), "num_experts_per_token"),
    (dict(num_experts=4, num_experts_per_token=2, scoring="sqrt_softplus"), "scoring"),
    (dict(num_experts=4, num_experts_per_token=2, scale=0.0), "scale"),
])
def test_routing_refuses_what_it_cannot_honour(fields, param):
    with pytest.raises(ModelLoadError) as error:
        Routing(**fields)
    assert error.value.param == param
    assert isinstance(error.value, UnsupportedError) == (param == "scoring")


def test_unknown_activation_and_mismatched_shapes_are_refused():
    with pytest.raises(UnsupportedError) as error:
        ExpertActivation("relu2")
    assert error.value.param == "activation"
    layer = _layer()
    with pytest.raises(ModelLoadError) as error:
        SparseMoE(layer.routing, layer.router_weight, layer.gate, layer.up, layer.down.transpose(1, 2))
    assert error.value.param == "ffn_down_exps"
    with pytest.raises(ModelLoadError) as error:
        SparseMoE(layer.routing, layer.router_weight, layer.gate, layer.up, layer.down,
                  shared_expert=SharedExpert(layer.gate[0], layer.up[0], layer.down[0], torch.zeros(3)))
    assert error.value.param == "ffn_gate_inp_shexp"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    shared_expert = SharedExpert(torch.randn(12, HIDDEN), torch.randn(12, HIDDEN), torch.randn(HIDDEN, 12),
                                 torch.randn(HIDDEN))
    layer = _layer(shared_expert=shared_expert)
    hidden = _hidden(33)
    expected = layer(hidden)
    actual = layer.to("cuda")(hidden.to("cuda"))
    assert actual.device.type == "cuda"
    torch.testing.assert_close(actual.cpu(), expected, atol=1e-5, rtol=1e-5)
    wide = torch.zeros(1, 128, device="cuda")
    wide[0, [120, 5, 64]] = 1.0
    assert route(wide, Routing(128, 4))[0].tolist() == [[5, 64, 120, 0]]
