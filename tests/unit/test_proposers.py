"""Speculative decoding without a model: n-gram lookup, the KV rollback with exact block ids,
the scheduler reserving and rolling back proposal slots, the speculator's adaptive k and
break-even switch-off, and request / config validation."""

from __future__ import annotations

import random

import pytest

from tokios.config import SpeculativeConfig
from tokios.errors import InvalidRequestError
from tokios.kv_cache.manager import KVCacheManager
from tokios.request import Request
from tokios.sampling_params import SamplingParams
from tokios.scheduler.scheduler import Scheduler
from tokios.speculative.proposers import NgramIndex, NgramProposer
from tokios.speculative.speculator import Speculator, expected_speedup

BLOCK_SIZE = 4


# ---- n-gram lookup ------------------------------------------------------------------------------
def scan_lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, as a backwards scan: the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = token_ids[len(token_ids) - n:]
        for end in range(len(token_ids) - 2, n - 2, -1):
            if token_ids[end - n + 1:end + 1] == suffix:
                return token_ids[end + 1:end + 1 + k]
    return []


def test_incremental_index_matches_the_scan_as_a_request_grows():
    rng = random.Random(5)
    for trial in range(30):
        min_n, max_n = rng.choice([(1, 4), (2, 3), (1, 1)])
        index = NgramIndex(min_n, max_n)
        token_ids = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        for _ in range(60):
            k = rng.randrange(1, 6)
            assert index.lookup(token_ids, k) == scan_lookup(token_ids, k, min_n, max_n), (trial, token_ids)
            token_ids = token_ids + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]


def test_proposer_keeps_one_index_per_request_and_drops_it():
    proposer = NgramProposer(min_n=1, max_n=2)
    request = Request("r", [1, 2, 3, 1, 2], SamplingParams(), 8)
    assert proposer.propose([request], [2], [[0]]) == [[3, 1]]
    assert "r" in proposer.request_to_index
    proposer.drop("r")
    assert proposer.request_to_index == {}


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    proposer = NgramProposer(min_n=1, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    token_ids = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # Suffix [2, 6, 7] never occurred before; [6, 7] did, latest at 6..7 -> followed by 2, 6, 7.
    assert proposer.lookup(token_ids, 3) == [2, 6, 7]
    assert proposer.lookup(token_ids, 1) == [2]


def test_ngram_prefers_longer_matches_and_stops_at_the_end_of_the_context():
    proposer = NgramProposer(min_n=1, max_n=2)
    token_ids = [1, 2, 3, 9, 2, 4, 1, 2]
    # [1, 2] matched at 0..1 -> 3, 9, 2 ...; the shorter [2] would match at 4 -> 4, 1, 2.
    assert proposer.lookup(token_ids, 2) == [3, 9]
    assert proposer.lookup([4, 4], 5) == [4]  # only one token follows the match


def test_ngram_without_a_match_proposes_nothing():
    proposer = NgramProposer(min_n=2, max_n=3)
    assert proposer.lookup([1, 2, 3, 4], 4) == []
    assert proposer.lookup([7], 4) == []


# ---- KV rollback --------------------------------------------------------------------------------
class FakeRequest:
    def __init__(self, request_id, token_ids):
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.num_computed_tokens = 0


def test_truncate_frees_the_blocks_past_the_kept_tokens_tail_first():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = FakeRequest("a", range(6))
    kv.allocate_slots(request, 6)
    request.num_computed_tokens = 5
    # Verify 1 + 4 proposed tokens at positions 5..9: room for 10 tokens = blocks 0, 1, 2.
    kv.allocate_slots(request, 5)
    assert kv.block_ids("a") == [0, 1, 2]
    # One proposal accepted: 7 tokens computed; block 2 (positions 8..11) held only rejects.
    assert kv.truncate(request, 7) == [2]
    assert kv.block_ids("a") == [0, 1]
    assert kv.pool.ref_counts[:3] == [1, 1, 0]
    assert kv.truncate(request, 8) == []  # nothing past two full blocks
    kv.check_invariants()
    kv.free(request)
    kv.check_invariants(expect_idle=True)


def test_blocks_holding_provisional_tokens_are_never_hashed():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = FakeRequest("a", range(7))
    kv.allocate_slots(request, 7)
    request.num_computed_tokens = 6
    # Last token (position 6) + 4 proposals at 7..10: block 1 (4..7) holds a proposal at 7.
    kv.allocate_slots(request, 5)
    assert kv.pool.block_hashes[0] is not None
    assert kv.pool.block_hashes[1] is None and kv.pool.block_hashes[2] is None
    # All rejected: blocks past position 6 go; the partial block 1 stays, unhashed.
    request.num_computed_tokens = 7
    assert kv.truncate(request, 7) == [2]
    assert kv.pool.block_hashes[1] is None
    # The accepted correction token makes block 1 full of real tokens: hashed at its next allocation.
    request.all_token_ids.append(99)
    kv.allocate_slots(request, 1)
    assert kv.pool.block_hashes[1] is not None
    kv.check_invariants()


# ---- scheduler --------------------------------------------------------------------------------
def make_decoding_request(scheduler: Scheduler, num_prompt: int, max_tokens: int, k: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    request = Request("r", list(range(100, 100 + num_prompt)), params, max_tokens)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update(output, {"r": [7]})  # prompt computed, first token sampled
    request.num_speculative_tokens = k
    return request


def test_scheduler_reserves_proposal_slots_and_rolls_back_the_rejected_ones():
    kv = KVCacheManager(16, BLOCK_SIZE)
    scheduler = Scheduler(kv, 4, 64, 1024)
    request = make_decoding_request(scheduler, 6, 32, k=4)
    output = scheduler.schedule()
    (scheduled,) = output.scheduled
    assert (scheduled.num_spec_slots, scheduled.num_new_tokens) == (4, 5)
    assert kv.block_ids("r") == [0, 1, 2]  # positions 0..10
    # The proposer found 3 tokens; 1 accepted, then a correction token.
    request.spec_token_ids = [8, 9, 10]
    scheduled.num_new_tokens = 4
    scheduler.update(output, {"r": [8, 42]})
    assert request.all_token_ids[-3:] == [7, 8, 42]
    assert request.num_computed_tokens == 8  # the prompt, 7 and 8; 42 is computed next step
    assert request.spec_token_ids == []
    assert kv.block_ids("r") == [0, 1]
    scheduler.check_invariants()


def test_scheduler_never_reserves_past_max_tokens_or_the_budget():
    kv = KVCacheManager(16, BLOCK_SIZE)
    scheduler = Scheduler(kv, 4, 3, 1024)  # a budget of 3 tokens
    request = make_decoding_request(scheduler, 2, 32, k=4)
    (scheduled,) = scheduler.schedule().scheduled
    assert scheduled.num_spec_slots == 2
    kv2 = KVCacheManager(16, BLOCK_SIZE)
    scheduler2 = Scheduler(kv2, 4, 64, 1024)
    make_decoding_request(scheduler2, 2, 3, k=4)  # 1 of 3 output tokens made
    (scheduled,) = scheduler2.schedule().scheduled
    assert scheduled.num_spec_slots == 1  # one accepted + one bonus reach max_tokens
    assert request.num_speculative_tokens == 4


def test_scheduler_drops_the_proposal_slots_before_preempting_anyone():
    kv = KVCacheManager(2, BLOCK_SIZE)  # 8 slots
    scheduler = Scheduler(kv, 4, 64, 1024)
    make_decoding_request(scheduler, 6, 32, k=4)  # position 6 fits block 1; 1 + 4 would need a 3rd
    (scheduled,) = scheduler.schedule().scheduled
    assert (scheduled.num_spec_slots, scheduled.num_new_tokens) == (0, 1)
    assert scheduler.num_preemptions == 0


# ---- speculator ----------------------------------------------------------------------------------
def test_expected_speedup_formula():
    assert expected_speedup(0.0, 4, 0.0) == pytest.approx(1.0)
    assert expected_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert expected_speedup(1.0, 3, 0.1) == pytest.approx(4 / 1.3)


def test_requests_choose_their_method_and_k_within_the_server_limits():
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=5), {"ngram": NgramProposer()})
    assert speculator.resolve(SamplingParams()) == ("ngram", 5)
    assert speculator.resolve(SamplingParams(speculative={"num_tokens": 2})) == ("ngram", 2)
    assert speculator.resolve(SamplingParams(speculative={"method": "none"}))[0] is None
    with pytest.raises(InvalidRequestError, match="speculative.num_tokens must be in \\[1, 5\\]"):
        speculator.resolve(SamplingParams(speculative={"num_tokens": 6}))
    with pytest.raises(InvalidRequestError, match="draft_model"):
        speculator.resolve(SamplingParams(speculative={"method": "draft_model"}))
    with pytest.raises(InvalidRequestError, match="speculative.method must be one of"):
        SamplingParams(speculative={"method": "medusa"})
    with pytest.raises(InvalidRequestError, match="speculative must be an object"):
        SamplingParams(speculative={"k": 3})


def test_requests_with_penalties_and_logprobs_speculate_too():
    # Verify rows count the earlier proposals for penalties and report logprobs
    # (tests/model/test_speculative.py checks the results against plain decoding).
    speculator = Speculator(SpeculativeConfig(method="ngram"), {"ngram": NgramProposer()})
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(logprobs=2)):
        request = Request("x", [1, 2], params, 8)
        speculator.admit(request)
        assert request.num_speculative_tokens == 4


class FakeScheduled:
    def __init__(self, request, num_spec_slots, num_new_tokens):
        self.request = request
        self.num_spec_slots = num_spec_slots
        self.num_new_tokens = num_new_tokens


class FakeOutput:
    def __init__(self, scheduled):
        self.scheduled = scheduled
        self.finished_request_ids = []


def test_adaptive_k_follows_acceptance_and_switches_off_below_break_even():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_token_cost=0.3)
    speculator = Speculator(config, {"ngram": NgramProposer()})
    good = Request("good", [1, 2], SamplingParams(temperature=0.0), 100)
    bad = Request("bad", [1, 2], SamplingParams(temperature=0.0), 100)
    speculator.admit(good)
    speculator.admit(bad)
    for _ in range(6):
        # good: all 4 accepted (+ bonus); bad: every first proposal rejected.
        speculator.observe(FakeOutput([FakeScheduled(good, 4, 5), FakeScheduled(bad, 4, 5)]),
                           {"good": [1, 2, 3, 4, 5], "bad": [9]}, step_seconds=0.01)
    assert good.num_speculative_tokens == 4
    assert bad.num_speculative_tokens == 0 and bad.spec_state.is_off
    stats = speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (12, 48, 24)
    assert stats.accepted_per_position == [6, 6, 6, 6] and stats.drafts_per_position == [12, 12, 12, 12]
    assert stats.num_requests_switched_off == 1


def test_config_validation_names_the_field():
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(InvalidRequestError, match="draft-model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(InvalidRequestError, match="speculative_method"):
        SpeculativeConfig(method="eagle")
