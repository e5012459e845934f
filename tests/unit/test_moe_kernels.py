"""The packed sparse MoE (model/kernels/experts.py, the C++ SparseExperts) against a dense
reference, per block type: model/moe.py's routing, then each chosen expert's product with the
weights the kernel holds (dequantize_packed) over the activations the kernel quantizes (8-bit
blocks, as test_kernels.kernel_activations rounds them), in float64.

Measured (Zen 4, AVX-512 VNNI): the largest difference is below 2e-6 of the output's largest
magnitude for every type (float32 sums against float64); asserted at 1e-4. A row whose 8-bit
activation rounds the other way in the float64 reference would move by about one step of 1/127
of its block, so the bound stays far below what a wrong expert, weight or slot gives (order 1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from tokios.model.blocks import KERNEL_TYPES, quantize
from tokios.model.kernels import FORMAT_BY_TYPE, load_extension
from tokios.model.kernels.experts import PackedSparseMoE
from tokios.model.moe import ExpertActivation, Routing, SharedExpert, route
from tokios.model.quant import PackedWeight

from test_kernels import kernel_activations

extension = load_extension()
pytestmark = pytest.mark.skipif(extension is None, reason="C++ kernel could not be built on this machine")

HIDDEN, INTERMEDIATE, NUM_EXPERTS, TOP_K = 256, 256, 8, 2
ALL_TYPES = sorted(KERNEL_TYPES, key=lambda t: t.value)


def packed_experts(weight: torch.Tensor, ggml_type: T, name: str) -> PackedWeight:
    """[E, out, in] float -> a 3-D PackedWeight as the loader holds a GGUF expert tensor."""
    num_experts, out_features, in_features = weight.shape
    rows = weight.reshape(-1, in_features).numpy()
    raw = torch.from_numpy(quantize(rows, ggml_type)).reshape(num_experts * out_features, -1)
    return PackedWeight(raw, ggml_type, (num_experts, out_features, in_features), name)


def dequantized_experts(moe: PackedSparseMoE, name: str, out_features: int, in_features: int) -> torch.Tensor:
    """The [E, out, in] weights the kernel multiplies by (expert by expert from its groups)."""
    packed = moe._packed[name]
    groups = packed.shape[0] // NUM_EXPERTS
    fmt = FORMAT_BY_TYPE[moe.expert_types[name]]
    return torch.stack([extension.dequantize_packed(packed[e * groups:(e + 1) * groups].contiguous(), fmt,
                                                    out_features, in_features) for e in range(NUM_EXPERTS)])


def reference(moe: PackedSparseMoE, x: torch.Tensor, router: torch.Tensor, activation=ExpertActivation(),
              biases=(None, None, None), router_bias=None, shared=None, router_input=None,
              expert_scale=None) -> torch.Tensor:
    gate = dequantized_experts(moe, "gate", INTERMEDIATE, HIDDEN).double()
    up = dequantized_experts(moe, "up", INTERMEDIATE, HIDDEN).double()
    down = dequantized_experts(moe, "down", HIDDEN, INTERMEDIATE).double()
    expert_ids, weights = route(F.linear(x if router_input is None else router_input, router, router_bias),
                                moe.routing)
    if expert_scale is not None:
        weights = weights * expert_scale[expert_ids]
    quantized_x = kernel_activations(x)
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
    for row in range(x.shape[0]):
        for slot in range(moe.routing.num_experts_per_token):
            e = int(expert_ids[row, slot])
            g = gate[e] @ quantized_x[row]
            u = up[e] @ quantized_x[row]
            if biases[0] is not None:
                g, u = g + biases[0][e].double(), u + biases[1][e].double()
            activated = activation(g.float(), u.float())
            d = down[e] @ kernel_activations(activated[None])[0]
            if biases[2] is not None:
                d = d + biases[2][e].double()
            out[row] += float(weights[row, slot]) * d
    if shared is not None:
        out += shared(x).double()
    return out


def random_moe(ggml_type: T, seed: int = 0, routing: Routing | None = None, router: torch.Tensor | None = None,
               **kwargs):
    generator = torch.Generator().manual_seed(seed)
    if router is None:
        router = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator) * 0.1
    weights = {name: torch.randn(NUM_EXPERTS, *shape, generator=generator) * 0.1
               for name, shape in (("gate", (INTERMEDIATE, HIDDEN)), ("up", (INTERMEDIATE, HIDDEN)),
                                   ("down", (HIDDEN, INTERMEDIATE)))}
    routing = routing or Routing(NUM_EXPERTS, TOP_K, normalize_top_k=True)
    moe = PackedSparseMoE(routing, router, *(packed_experts(w, ggml_type, f"ffn_{n}_exps") for n, w in weights.items()),
                          **kwargs)
    return moe, router


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    error = (ours.double() - theirs).abs().max() / theirs.abs().max()
    assert error < 1e-4, f"relative error {float(error):.2e}"


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_every_block_type_equals_the_dense_reference(ggml_type):
    moe, router = random_moe(ggml_type)
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert_close(moe(x), reference(moe, x, router))


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    moe, _ = random_moe(T.Q4_K)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2))
    batch = moe(x)
    for row in (0, 5, 36):
        assert torch.equal(moe(x[row:row + 1])[0], batch[row])
    assert torch.equal(moe(x[10:20]), batch[10:20])


def _one_expert_router(expert_id: int) -> torch.Tensor:
    """A router under which every row of positive activations chooses `expert_id` first."""
    router = torch.zeros(NUM_EXPERTS, HIDDEN)
    router[expert_id] = 1.0
    return router


def test_only_the_chosen_experts_are_read():
    """All rows choose expert 3; every other expert's bytes are then overwritten with NaN blocks
    (fp16 scales of 0xFFFF): the output is unchanged, and the bytes a call counts are expert 3's
    and the router's."""
    moe, _ = random_moe(T.Q4_K, routing=Routing(NUM_EXPERTS, 1), router=_one_expert_router(3))
    x = torch.rand(6, HIDDEN, generator=torch.Generator().manual_seed(3))
    before = moe(x)
    chosen_bytes = 0
    for packed in moe._packed.values():
        groups = packed.shape[0] // NUM_EXPERTS
        chosen_bytes += groups * packed.shape[1]
        for e in range(NUM_EXPERTS):
            if e != 3:
                packed[e * groups:(e + 1) * groups] = 0xFF
    read_before = moe.weight_bytes_read
    after = moe(x)
    assert torch.isfinite(after).all() and torch.equal(after, before)
    assert moe.weight_bytes_read - read_before == chosen_bytes + NUM_EXPERTS * HIDDEN * 4


def test_an_expert_no_row_chose_is_never_read_in_a_mixed_batch():
    moe, router = random_moe(T.Q8_0, seed=4)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    expert_ids, _ = route(F.linear(x, router), moe.routing)
    unused = sorted(set(range(NUM_EXPERTS)) - set(expert_ids.flatten().tolist()))
    assert unused, "the seed must leave some expert unchosen"
    before = moe(x)
    for packed in moe._packed.values():
        groups = packed.shape[0] // NUM_EXPERTS
        for e in unused:
            packed[e * groups:(e + 1) * groups] = 0xFF
    assert torch.equal(moe(x), before)


def test_no_rows():
    moe, _ = random_moe(T.Q4_0)
    assert moe(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)


def packed_2d(weight: torch.Tensor, ggml_type: T) -> PackedWeight:
    raw = torch.from_numpy(quantize(weight.numpy(), ggml_type)).reshape(weight.shape[0], -1)
    return PackedWeight(raw, ggml_type, tuple(weight.shape), "shared")


def test_shared_expert_with_its_gate():
    generator = torch.Generator().manual_seed(6)
    shared_intermediate = 96
    gate, up = (torch.randn(shared_intermediate, HIDDEN, generator=generator) * 0.1 for _ in range(2))
    down = torch.randn(HIDDEN, shared_intermediate, generator=generator) * 0.1
    output_gate = torch.randn(HIDDEN, generator=generator) * 0.1
    packed = [packed_2d(w, T.Q8_0) for w in (gate, up, down)]
    moe, router = random_moe(T.Q5_K, seed=7, routing=Routing(NUM_EXPERTS, TOP_K),
                             shared_expert=SharedExpert(*packed, output_gate))
    weights = [p.dequantize().double() for p in packed]

    def shared_reference(x):
        quantized_x = kernel_activations(x)
        activated = F.silu((quantized_x @ weights[0].T).float()) * (quantized_x @ weights[1].T).float()
        out = kernel_activations(activated) @ weights[2].T
        return torch.sigmoid(x.double() @ output_gate.double())[:, None] * out

    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(8))
    ours = moe(x)
    assert_close(ours, reference(moe, x, router, shared=shared_reference))
    assert (ours.double() - reference(moe, x, router)).abs().max() > 1e-2  # the shared expert counts


def test_gpt_oss_routing_activation_and_biases():
    """top-k of the logits then a softmax over those k, the router's bias, per-expert biases on
    gate, up and down, and the clamped SwiGLU (limit low enough that the clamps act)."""
    generator = torch.Generator().manual_seed(9)
    activation = ExpertActivation("swiglu_oai", alpha=1.702, limit=0.5)
    biases = (torch.randn(NUM_EXPERTS, INTERMEDIATE, generator=generator),
              torch.randn(NUM_EXPERTS, INTERMEDIATE, generator=generator),
              torch.randn(NUM_EXPERTS, HIDDEN, generator=generator))
    router_bias = torch.randn(NUM_EXPERTS, generator=generator)
    moe, router = random_moe(T.Q8_0, seed=10, routing=Routing(NUM_EXPERTS, TOP_K, scoring="top_k_softmax"),
                             activation=activation, router_bias=router_bias, gate_bias=biases[0],
                             up_bias=biases[1], down_bias=biases[2])
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(11))
    assert_close(moe(x), reference(moe, x, router, activation, biases, router_bias))


@pytest.mark.parametrize("weight_format, ggml_type", [("int4", T.Q4_1), ("int8", T.Q8_0)])
def test_dense_experts_convert_with_the_dtype(weight_format, ggml_type):
    generator = torch.Generator().manual_seed(12)
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator) * 0.1
    dense = [torch.randn(NUM_EXPERTS, *shape, generator=generator) * 0.1
             for shape in ((INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE))]
    moe = PackedSparseMoE(Routing(NUM_EXPERTS, TOP_K), router, *dense, weight_format=weight_format,
                          precise=weight_format == "int8")  # as precise_activations() has it
    assert set(moe.expert_types.values()) == {ggml_type}
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(13))
    if weight_format == "int4":
        assert_close(moe(x), reference(moe, x, router))
    expert_ids, weights = route(F.linear(x, router), moe.routing)
    gate, up, down = dense

    def expert(e: int, row: torch.Tensor) -> torch.Tensor:
        return down[e] @ (F.silu(gate[e] @ row) * (up[e] @ row))

    exact = torch.stack([sum(float(weights[r, s]) * expert(e, x[r]) for s, e in enumerate(expert_ids[r].tolist()))
                         for r in range(len(x))])
    # The conversion keeps the product near the float weights': root-mean-square error relative
    # to the outputs' root mean square measured 0.14 for Q4_1 and 0.010 for Q8_0 (precise
    # activations), about what the weights' rounding gives over three products.
    error = ((moe(x) - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
    assert error < (0.2 if weight_format == "int4" else 0.02)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "top_k_softmax"])
def test_equal_router_scores_choose_the_lower_expert_ids(scoring):
    """A zero router gives every expert the same score: experts 0 and 1 are chosen (route's rule),
    with equal weights."""
    moe, router = random_moe(T.Q4_1, seed=14, routing=Routing(NUM_EXPERTS, TOP_K, scoring=scoring),
                             router=torch.zeros(NUM_EXPERTS, HIDDEN))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(15))
    assert route(F.linear(x, router), moe.routing)[0].tolist() == [[0, 1]] * 3
    assert_close(moe(x), reference(moe, x, router))


def test_gemma4_router_input_and_per_expert_scale():
    """Gemma 4's router reads its own input (the residual normed without weights), and each
    expert's output has its own scale."""
    generator = torch.Generator().manual_seed(16)
    expert_scale = torch.rand(NUM_EXPERTS, generator=generator) + 0.5
    moe, router = random_moe(T.Q4_K, seed=17, expert_scale=expert_scale)
    x = torch.randn(6, HIDDEN, generator=generator)
    router_input = torch.randn(6, HIDDEN, generator=generator)
    ours = moe(x, router_input)
    assert_close(ours, reference(moe, x, router, router_input=router_input, expert_scale=expert_scale))
    assert (ours.double() - reference(moe, x, router, expert_scale=expert_scale)).abs().max() > 1e-2
