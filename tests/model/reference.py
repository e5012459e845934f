"""The independent reference: Hugging Face transformers loading the same GGUF file in float32.

Owns loading that model once per test session (about 20 s here) and the few things the model
tests ask of it: greedy continuations through transformers' own generate(), logits at every
prompt position, and perplexity. Also the engine-side counterparts that need the engine's
internals (full prompt logits from the model file, perplexity from prompt logprobs), so every
test computes them the same way.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import os
from pathlib import Path

import pytest
import torch

from tokios.model_files import default_model_path


def default_gguf() -> Path:
    return default_model_path()


@functools.lru_cache(maxsize=2)
def load_reference_model(path: Path | None = None):
    """transformers' model for a GGUF (default: the default model), float32, eval mode. Loaded at
    most once per file (Gemma 3 270M takes about 30 s here)."""
    return reference_model_from(Path(path or default_gguf()))


def reference_model_from(path: Path):
    """transformers' model for a GGUF file, float32, eval mode, not kept (for files made by a test)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    with gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()


@functools.lru_cache(maxsize=2)
def load_reference_tokenizer(path: Path):
    """transformers' tokenizer for a GGUF (its own conversion; about 25 s for Gemma 3's vocabulary)."""
    transformers = pytest.importorskip("transformers")
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


_shared_readers: collections.OrderedDict[str, object] = collections.OrderedDict()


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers parses a GGUF file once for its config and again for the weights (or the
    vocabulary); Gemma 3's 262,144-token vocabulary makes each parse about 20 s of Python here.
    Inside this block the gguf library's reader is built once per file and shared: the same
    reader, read-only, so what transformers loads does not change. The last two files' readers
    are kept for the next block too (Gemma 3's model and then its tokenizer: 14 s saved). So is
    the tensor name map, which transformers rebuilds for every submodule of the model (397 times
    for SmolLM2, each formatting every name pattern for every layer: about 5 s a load)."""
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def shared_reader(path, *args, **kwargs):
        stat = os.stat(path)
        key = repr((str(path), stat.st_mtime_ns, stat.st_size, args, sorted(kwargs.items())))
        if key not in _shared_readers:
            _shared_readers[key] = original_reader(path, *args, **kwargs)
            while len(_shared_readers) > 2:
                _shared_readers.popitem(last=False)
        _shared_readers.move_to_end(key)
        return _shared_readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """A test prompt's ids: a conversation (a list of messages) through the chat template, or text."""
    if isinstance(prompt, list):
        return tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True),
                                add_special_tokens=False)
    return tokenizer.encode(prompt)


def reference_greedy(model, prompt_token_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' generate(do_sample=False) for exactly num_tokens new tokens (EOS ignored,
    so the comparison always covers num_tokens positions)."""
    input_ids = torch.tensor([prompt_token_ids])
    config = model.generation_config
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=num_tokens, min_new_tokens=0, eos_token_id=None,
                                pad_token_id=config.pad_token_id if config.pad_token_id is not None else 0,
                                temperature=None, top_p=None, top_k=None)
    new_token_ids = output[0, len(prompt_token_ids):].tolist()
    assert len(new_token_ids) == num_tokens, "transformers stopped early: EOS was not ignored"
    return new_token_ids


def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """[num_tokens, vocab] float32 logits at every position."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def perplexity_from_logits(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood of token i+1 given tokens 0..i)."""
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = torch.tensor(token_ids[1:])
    return math.exp(-logprobs.gather(1, targets[:, None]).mean().item())


def engine_perplexity(llm, token_ids: list[int]) -> float:
    """The engine's perplexity of token_ids, through the public prompt-logprobs path."""
    from tokios.sampling_params import SamplingParams

    (output,) = llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    entries = output.prompt_logprobs
    assert entries[0] is None and len(entries) == len(token_ids)
    total = sum(entry[token_id].logprob for entry, token_id in zip(entries[1:], token_ids[1:]))
    return math.exp(-total / (len(token_ids) - 1))


def engine_prompt_logits(llm, token_ids: list[int]) -> torch.Tensor:
    """[num_tokens, vocab] logits from the engine's model file in one causal pass over a scratch
    paged KV cache (the engine's public API only exposes logprobs, not raw logits)."""
    from tokios.model.attention import AttentionMetadata, MultiTokenSpan

    model = llm.core.model
    config = llm.model_config
    num_tokens = len(token_ids)
    kv_dtype = model.dtype
    # Every layer that stores K/V its own cache of its own head shape, which the layers reading
    # its K/V share; a sliding layer gets the causal mask cut to its window.
    layer_to_cache = {layer: (torch.zeros((num_tokens, *config.kv_shape_of(layer)), dtype=kv_dtype),
                              torch.zeros((num_tokens, *config.kv_shape_of(layer)), dtype=kv_dtype))
                      for layer in config.kv_layers}
    kv_caches = [layer_to_cache[config.kv_source_of(layer)] for layer in range(config.num_layers)]
    slots = torch.arange(num_tokens)
    positions = torch.arange(num_tokens)
    causal = positions[None, :] <= positions[:, None]

    def metadata_for(window):
        mask = None if window is None else causal & (positions[:, None] - positions[None, :] < window)
        return AttentionMetadata(slot_mapping=slots, num_decode_tokens=0,
                                 spans=[MultiTokenSpan(0, num_tokens, num_tokens, slots, mask)])

    metadata = metadata_for(None)
    if config.layer_windows is not None:
        metadata.groups = [metadata_for(config.window_of(layer)) for layer in range(config.num_layers)]
        metadata.layer_to_group = tuple(range(config.num_layers))
    with torch.no_grad():
        hidden = model.forward(torch.tensor(token_ids), slots, metadata, kv_caches)
        return model.compute_logits(hidden)
