"""Sampler behaviour in mixed batches: seeds, greedy rows, logprobs, min_tokens, bias, state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokios.sampler import Sampler, SamplingMetadata, SamplingStateStore, compute_processed_probs, make_generator
from tokios.sampler import ops
from tokios.sampling_params import SamplingParams

VOCAB_SIZE = 256
EOS_ID = 3


def build(params, logits_rows=None, outputs=None, prompts=None, generators=None, suppress=None):
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts or [[1, 2]] * num_rows,
        outputs or [[]] * num_rows,
        generators or [None] * num_rows,
        suppress or [frozenset()] * num_rows,
        VOCAB_SIZE,
        "cpu",
    )


def mixed_batch_params() -> list[SamplingParams]:
    """16 requests with different settings; row 5 is the seeded request under test."""
    return [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.1, seed=11, top_k=20),
        SamplingParams(temperature=0.6, repetition_penalty=1.3),
        SamplingParams(temperature=0, frequency_penalty=0.5, logprobs=3),
        SamplingParams(temperature=0.9, seed=1234, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=0.4),
        SamplingParams(temperature=1.0, logit_bias={7: 5.0}),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, min_p=0.1, seed=5),
        SamplingParams(temperature=0.5, logprobs=20, min_tokens=2),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0, logit_bias={9: -100.0}),
        SamplingParams(temperature=2.0, top_p=0.5, seed=99),
        SamplingParams(temperature=0.3, frequency_penalty=-1.0, presence_penalty=1.0),
        SamplingParams(temperature=1.0, top_k=5, seed=5),
        SamplingParams(temperature=0.95, repetition_penalty=0.8, logprobs=0),
    ]


def run_steps(rows_params, row_logits_per_step, store, states, sampler):
    """Decode loop in the runner's shape: one metadata per step, outputs grow by the sampled token."""
    outputs = [[] for _ in states]
    for step_logits in row_logits_per_step:
        metadata = SamplingMetadata.from_states(store, states, outputs)
        sampled = sampler(step_logits, metadata).sampled_token_ids.tolist()
        for output, token_id in zip(outputs, sampled):
            output.append(token_id)
    return outputs


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch_of_16():
    params = mixed_batch_params()
    num_steps = 12
    torch.manual_seed(0)
    batch_logits = [torch.randn(16, VOCAB_SIZE) * 2 for _ in range(num_steps)]
    prompt = [4, 8, 15, 16]

    store = SamplingStateStore(VOCAB_SIZE, "cpu")
    states = [store.add(p, prompt, frozenset({EOS_ID})) for p in params]
    in_batch = run_steps(params, batch_logits, store, states, Sampler(torch.Generator().manual_seed(1)))

    for row in (2, 5, 12):
        alone_store = SamplingStateStore(VOCAB_SIZE, "cpu")
        alone_state = [alone_store.add(params[row], prompt, frozenset({EOS_ID}))]
        alone_logits = [step[row : row + 1] for step in batch_logits]
        # A different shared generator: the seeded row must not depend on it.
        alone = run_steps([params[row]], alone_logits, alone_store, alone_state, Sampler(torch.Generator().manual_seed(77)))
        assert alone[0] == in_batch[row]

    # Same seed and settings at another position of a reshuffled batch.
    order = list(reversed(range(16)))
    shuffled_store = SamplingStateStore(VOCAB_SIZE, "cpu")
    shuffled_states = [shuffled_store.add(params[i], prompt, frozenset({EOS_ID})) for i in order]
    shuffled = run_steps(
        [params[i] for i in order], [step[order] for step in batch_logits], shuffled_store, shuffled_states, Sampler()
    )
    assert shuffled[order.index(5)] == in_batch[5]
    # A seeded request is not constant: the stream moves on between steps.
    assert len(set(in_batch[5])) > 1


def test_greedy_rows_are_the_argmax_and_temperature_zero_equals_top_k_one():
    torch.manual_seed(1)
    logits = torch.randn(16, VOCAB_SIZE)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=1)] * 4
    params += [SamplingParams(temperature=1.0, seed=i) for i in range(8)]
    metadata = build(params)
    assert not metadata.is_plain_greedy and metadata.is_greedy_row is not None
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert sampled[:8].tolist() == logits[:8].argmax(dim=-1).tolist()
    # The random rows really are random: they differ from the argmax somewhere.
    assert sampled[8:].tolist() != logits[8:].argmax(dim=-1).tolist()


def test_plain_greedy_fast_path_matches_the_full_path():
    torch.manual_seed(2)
    logits = torch.randn(16, VOCAB_SIZE)
    plain = build([SamplingParams(temperature=0)] * 16)
    assert plain.is_plain_greedy
    # A zero bias forces the edit path without changing any logit.
    edited = build([SamplingParams(temperature=0, logit_bias={0: 0.0})] * 16)
    assert not edited.is_plain_greedy
    assert torch.equal(Sampler()(logits, plain).sampled_token_ids, Sampler()(logits, edited).sampled_token_ids)


def test_greedy_applies_penalties_and_bias_before_the_argmax():
    logits = torch.zeros(2, VOCAB_SIZE)
    logits[:, 10] = 3.0
    logits[:, 11] = 2.0
    logits[:, 12] = 1.0
    params = [
        SamplingParams(temperature=0, repetition_penalty=2.0),  # 10 seen: 3/2 = 1.5 < 2.0 -> 11
        SamplingParams(temperature=0, logit_bias={12: 2.5}),  # 1 + 2.5 = 3.5 -> 12
    ]
    metadata = build(params, prompts=[[10], [10]])
    assert Sampler()(logits, metadata).sampled_token_ids.tolist() == [11, 12]


def test_logprobs_are_log_softmax_of_the_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(16, VOCAB_SIZE) * 3
    params = mixed_batch_params()
    output = Sampler()(logits, build(params))
    expected = logits.double().numpy()
    expected = expected - np.log(np.exp(expected - expected.max(1, keepdims=True)).sum(1, keepdims=True)) - expected.max(1, keepdims=True)
    sampled = output.sampled_token_ids.numpy()
    rows = np.arange(16)
    np.testing.assert_allclose(output.sampled_logprobs.numpy(), expected[rows, sampled], atol=1e-4)
    assert output.top_logprobs.shape == (16, 20)  # K = the largest request in the batch
    np.testing.assert_allclose(output.top_logprobs.numpy(), -np.sort(-expected, axis=1)[:, :20], atol=1e-4)
    assert (output.top_logprob_ids.numpy() == np.argsort(-expected, axis=1)[:, :20]).all()
    expected_ranks = (expected > expected[rows, sampled][:, None]).sum(1) + 1
    assert output.sampled_token_ranks.tolist() == expected_ranks.tolist()


def test_sampled_logprob_without_top_logprobs():
    torch.manual_seed(4)
    logits = torch.randn(4, VOCAB_SIZE)
    output = Sampler()(logits, build([SamplingParams(temperature=0.8, logprobs=0)] * 4))
    assert output.top_logprobs.shape == (4, 0)
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, output.sampled_token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(output.sampled_logprobs.double(), expected, atol=1e-5, rtol=0)


def test_no_logprobs_are_computed_when_no_row_asks():
    output = Sampler()(torch.randn(4, VOCAB_SIZE), build([SamplingParams(temperature=0.8)] * 4))
    assert output.sampled_logprobs is None and output.top_logprobs is None


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, VOCAB_SIZE)
    logits[:, EOS_ID] = 50.0
    logits[:, 30] = 40.0
    logits[:, 20] = 10.0
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[30])] * 2 + [SamplingParams(temperature=0.5, min_tokens=1)]
    suppress = [frozenset({EOS_ID, 30})] * 2 + [frozenset({EOS_ID})]
    outputs = [[5], [5, 6], []]
    sampled = Sampler()(logits, build(params, outputs=outputs, suppress=suppress)).sampled_token_ids.tolist()
    # Row 0 is short: EOS and 30 are held back. Row 1 reached min_tokens. Row 2's only suppressed
    # id is EOS, so 30 (prob ~1 at T=0.5) is drawn.
    assert sampled == [20, EOS_ID, 30]


def test_logit_bias_forces_and_bans_tokens():
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB_SIZE)
    banned = int(logits[1].argmax())
    params = [
        SamplingParams(temperature=1.0, logit_bias={42: 100.0}, seed=1),
        SamplingParams(temperature=0, logit_bias={banned: -100.0}),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logit_bias={42: 100.0}),
    ]
    sampled = Sampler()(logits, build(params)).sampled_token_ids.tolist()
    assert sampled[0] == 42 and sampled[3] == 42
    assert sampled[1] == int(logits[1].topk(2).indices[1])
    assert sampled[2] == int(logits[2].argmax())


def test_incremental_state_matches_a_stateless_rebuild():
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3), SamplingParams(), SamplingParams(presence_penalty=1.0)]
    prompts = [[1, 2, 3], [4], [5, 5]]
    store = SamplingStateStore(VOCAB_SIZE, "cpu", initial_num_rows=2)  # forces one table growth
    states = [store.add(p, prompt) for p, prompt in zip(params, prompts)]
    outputs = [[], [], []]
    for step in range(5):
        for row, output in enumerate(outputs):
            output.append((7 * step + row) % 11)
        incremental = SamplingMetadata.from_states(store, states, outputs)
        fresh = build(params, outputs=[list(o) for o in outputs], prompts=prompts)
        assert torch.equal(incremental.output_token_counts, fresh.output_token_counts)
        assert torch.equal(incremental.prompt_token_mask, fresh.prompt_token_mask)
    assert incremental.output_token_counts[1].sum() == 0  # no penalties: the shared zero row
    # A rollback (shorter output) recounts; a removed request's row comes back clean.
    outputs[0] = outputs[0][:2]
    rolled_back = SamplingMetadata.from_states(store, states, outputs)
    assert rolled_back.output_token_counts[0].sum() == 2
    row = states[0].penalty_row
    store.remove(states[0])
    reused = store.add(SamplingParams(frequency_penalty=1.0), [9])
    assert reused.penalty_row == row
    assert store.output_token_counts[row].sum() == 0 and not store.prompt_token_mask[row].any()


def test_processed_probs_are_the_distribution_that_is_drawn():
    torch.manual_seed(6)
    logits = torch.randn(3, VOCAB_SIZE) * 2
    params = [SamplingParams(temperature=0.7, top_k=10, top_p=0.8), SamplingParams(temperature=0), SamplingParams(min_p=0.2)]
    probs = compute_processed_probs(logits, build(params))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))
    assert probs[1].tolist() == torch.nn.functional.one_hot(logits[1].argmax(), VOCAB_SIZE).float().tolist()
    assert int((probs[0] > 0).sum()) <= 10
    # Every token a seeded sampler draws for row 0 has non-zero processed probability.
    metadata = build([params[0]] * 500, generators=[make_generator(i, "cpu") for i in range(500)])
    sampled = Sampler()(logits[0:1].repeat(500, 1), metadata).sampled_token_ids
    assert (probs[0][sampled] > 0).all()


def test_top_p_candidate_search_equals_the_full_sort():
    torch.manual_seed(7)
    # High-entropy rows need nearly the whole vocab: the narrow search must widen to stay exact.
    logits = torch.cat([torch.randn(4, VOCAB_SIZE) * 0.1, torch.randn(4, VOCAB_SIZE) * 8])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.99, 0.9, 0.5, 1.0, 0.2])
    narrow = ops.apply_top_p(logits, top_p, initial_num_candidates=2)
    full = ops.apply_top_p(logits, top_p, initial_num_candidates=None)
    assert torch.equal(narrow, full)
    assert torch.isfinite(full[2]).all() and torch.isfinite(full[6]).all()


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.5, float(np.nextafter(1.0, 0.0))):
        sampled = ops.sample_from_probs(probs, torch.full((2,), u, dtype=torch.float64))
        assert sampled[0].item() in (1, 3) and sampled[1].item() == 2


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, VOCAB_SIZE + 1), build([SamplingParams()] * 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_row_matches_alone_and_greedy_matches_argmax():
    device = torch.device("cuda")
    params = mixed_batch_params()
    logits = torch.randn(16, VOCAB_SIZE, device=device) * 2
    store = SamplingStateStore(VOCAB_SIZE, device)
    states = [store.add(p, [1, 2]) for p in params]
    sampled = Sampler()(logits, SamplingMetadata.from_states(store, states, [[]] * 16)).sampled_token_ids
    alone_store = SamplingStateStore(VOCAB_SIZE, device)
    alone = Sampler()(logits[5:6], SamplingMetadata.from_states(alone_store, [alone_store.add(params[5], [1, 2])], [[]]))
    assert sampled.device.type == "cuda"
    assert sampled[5].item() == alone.sampled_token_ids[0].item()
    assert sampled[0].item() == logits[0].argmax().item()


@pytest.mark.parametrize("initial_num_candidates", [1, 2, 64, None])
def test_fused_truncation_equals_top_k_then_top_p_then_min_p(initial_num_candidates):
    generator = torch.Generator().manual_seed(8)
    num_rows = 24
    scales = torch.tensor([0.1, 1.0, 4.0, 10.0]).repeat(num_rows // 4).unsqueeze(1)
    logits = torch.randn(num_rows, VOCAB_SIZE, generator=generator) * scales
    top_k = torch.tensor([1, 5, 40, VOCAB_SIZE, VOCAB_SIZE, 200] * 4)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.95, 1.0, 0.3, 0.99, 0.7] * 3)
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.3, 0.0, 0.01] * 4)
    max_top_k = int(top_k[top_k < VOCAB_SIZE].max())
    reference = ops.apply_min_p(ops.apply_top_p(ops.apply_top_k(logits, top_k, max_top_k), top_p), min_p)
    fused = ops.apply_truncation(logits, top_k, max_top_k, top_p, min_p, initial_num_candidates)
    assert torch.equal(torch.isfinite(fused), torch.isfinite(reference))
    assert torch.equal(fused, reference)
    # Each cut alone, too.
    assert torch.equal(ops.apply_truncation(logits, top_k, max_top_k, None, None, 1), ops.apply_top_k(logits, top_k, max_top_k))
    assert torch.equal(ops.apply_truncation(logits, None, VOCAB_SIZE, None, min_p, 1), ops.apply_min_p(logits, min_p))
    assert torch.equal(ops.apply_truncation(logits, None, VOCAB_SIZE, top_p, None, initial_num_candidates), ops.apply_top_p(logits, top_p))


def test_pending_tokens_count_on_their_row_only_and_never_persist():
    # Speculative verify rows: row j sees the request's output plus the proposals before j.
    store = SamplingStateStore(VOCAB_SIZE, "cpu")
    params = SamplingParams(frequency_penalty=1.0, min_tokens=3)
    state = store.add(params, [1, 2], frozenset({EOS_ID}))
    output = [5]
    pending = [[], [7], [7, 7]]
    metadata = SamplingMetadata.from_states(store, [state] * 3, [output] * 3, pending)
    counts = metadata.output_token_counts
    assert counts[:, 5].tolist() == [1, 1, 1]
    assert counts[:, 7].tolist() == [0, 1, 2]
    # min_tokens = 3: rows with output length 1 and 2 suppress EOS, the row at length 3 does not.
    assert sorted(set(metadata.suppressed_rows.tolist())) == [0, 1]
    assert store.output_token_counts[state.penalty_row, 7].item() == 0  # the store counts the output only
    assert store.output_token_counts[state.penalty_row, 5].item() == 1
