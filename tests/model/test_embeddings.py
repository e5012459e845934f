"""Pooled prompt hidden states (the embedding routes): equal to transformers' final hidden
states on the same GGUF in float32, mean and last pooling, a prompt longer than one prefill chunk
included; unchanged by batching and by a cached prefix (a pooling request computes its whole
prompt)."""

from __future__ import annotations

import torch

from tokios.sampling_params import SamplingParams

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today.",
         "Zażółć gęślą jaźń, " * 30]


def pooled(llm, texts: list[str], pooling: str) -> list[torch.Tensor]:
    outputs = llm.generate(texts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, pooling=pooling))
    return [torch.tensor(output.embedding) for output in outputs]


def test_mean_and_last_pooling_equal_transformers_hidden_states(engine_float32, reference_model):
    means, lasts = pooled(engine_float32, TEXTS, "mean"), pooled(engine_float32, TEXTS, "last")
    for text, mean, last in zip(TEXTS, means, lasts):
        ids = engine_float32.tokenizer.encode(text, add_special_tokens=True)
        with torch.no_grad():
            hidden = reference_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        for embedding, expected in ((mean, hidden.mean(dim=0)), (last, hidden[-1])):
            assert embedding.shape == expected.shape == (engine_float32.model_config.hidden_size,)
            assert torch.allclose(embedding, expected, atol=2e-3, rtol=1e-4), (text[:20],
                                                                               float((embedding - expected).abs().max()))


def test_pooling_does_not_change_with_batching_or_a_cached_prefix(engine_float32):
    alone = [pooled(engine_float32, [text], "mean")[0] for text in TEXTS]
    batched = pooled(engine_float32, TEXTS, "mean")
    again = pooled(engine_float32, TEXTS, "mean")  # every prompt's blocks are in the prefix cache now
    for single, together, cached in zip(alone, batched, again):
        assert torch.allclose(single, together, atol=1e-4) and torch.allclose(single, cached, atol=1e-4)
    long_ids = engine_float32.tokenizer.encode(TEXTS[-1], add_special_tokens=True)
    assert len(long_ids) > engine_float32.engine_config.scheduler.max_num_batched_tokens  # several prefill chunks
