"""Sampler package: turns a batch of logits into next tokens, one request's settings per row.

Public API (see docs/sampling.md): the model runner keeps a SamplingStateStore and one
RequestSamplingState per request, builds a SamplingMetadata each step, and calls a Sampler.
Speculative decoding reuses compute_processed_probs and ops.sample_from_probs.
"""

from tokios.sampler.metadata import SamplingMetadata
from tokios.sampler.ops import draw_uniforms, gather_logprobs, sample_from_probs
from tokios.sampler.sampler import Sampler, SamplerOutput, compute_processed_probs, greedy_tokens
from tokios.sampler.state import RequestSamplingState, SamplingStateStore, make_generator

__all__ = [
    "RequestSamplingState",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingStateStore",
    "compute_processed_probs",
    "greedy_tokens",
    "draw_uniforms",
    "gather_logprobs",
    "make_generator",
    "sample_from_probs",
]
