"""What speculation is expected to earn: the one formula the speculator's adaptive k and
`tokios plan` both use. No torch here, so the planner reads it without loading the engine.

With acceptance rate a (each draft token accepted independently) and k draft tokens, a verify
emits the accepted prefix plus the one token the target adds: (1 - a^(k+1)) / (1 - a) tokens on
average. It costs one target step plus k draft steps of c target steps each, so the speed-up over
plain decoding is that count / (1 + k c).
"""

from __future__ import annotations


def expected_tokens_per_verify(acceptance: float, num_tokens: int) -> float:
    """(1 - a^(k+1)) / (1 - a): the accepted draft prefix plus the one token the target adds."""
    if acceptance >= 1.0:
        return float(num_tokens + 1)
    return (1.0 - acceptance ** (num_tokens + 1)) / (1.0 - acceptance)


def expected_speedup(acceptance: float, num_tokens: int, cost: float) -> float:
    """(1 - a^(k+1)) / (1 - a) / (1 + k c): tokens per verification over its relative cost, each
    draft token costing `cost` of a target step."""
    return expected_tokens_per_verify(acceptance, num_tokens) / (1.0 + num_tokens * cost)
