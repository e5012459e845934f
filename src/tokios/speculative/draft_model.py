"""Loading a separate draft model (--draft-model PATH) into a ModelDraftProposer.

The draft gets its own weights and its own KV cache tensors, one pair per draft layer, with as
many slots as the target's cache: it is addressed with the target's block ids, so the target's
KV manager allocates (and rolls back) for both, and no second allocator exists. A draft whose
tokenizer differs from the target's is refused with InvalidRequestError before anything runs.

Talks to: model/loader.py (load_model), tokenizer (compatibility), speculative/proposers.py.
"""

from __future__ import annotations

import logging

from tokios.config import AUTO_DTYPE_BY_DEVICE, SpeculativeConfig
from tokios.errors import InvalidRequestError, UnsupportedError
from tokios.model.attention import allocate_kv_caches
from tokios.kv_cache.dtypes import kv_bytes_per_element
from tokios.model.dtypes import kv_cache_dtype
from tokios.model.loader import load_model
from tokios.speculative.proposers import ModelDraftProposer, check_tokenizers_compatible
from tokios.tokenizer import tokenizer_for_loaded_model

logger = logging.getLogger("tokios.speculative")


def load_draft_proposer(spec: SpeculativeConfig, core, num_blocks: int, block_size: int) -> ModelDraftProposer:
    """core: the EngineCore being built (its device, tokenizer, model config and runner)."""
    weight_format = spec.draft_dtype
    if weight_format == "auto":
        weight_format = AUTO_DTYPE_BY_DEVICE[core.device.type]
    try:
        loaded = load_model(str(spec.draft_model), weight_format, core.device)
    except FileNotFoundError as exc:
        raise InvalidRequestError(f"draft model {spec.draft_model} not found: {exc}", param="draft_model") from exc
    tokenizer = tokenizer_for_loaded_model(loaded.tokenizer_source, str(spec.draft_model))
    check_tokenizers_compatible(core.tokenizer, tokenizer, core.model_config.vocab_size, loaded.config.vocab_size,
                                str(spec.draft_model))
    config = loaded.config
    if config.layer_windows is not None:
        # The draft's cache is addressed by the target's group-0 (full-attention) block table.
        raise UnsupportedError(f"draft model {spec.draft_model} has sliding-window layers; a draft must attend "
                               "fully (a Llama-family model)")
    kv_dtype = kv_cache_dtype(weight_format, core.config.cache.kv_cache_dtype)
    kv_caches = allocate_kv_caches(config, num_blocks * block_size, kv_dtype, core.device)
    logger.info("draft model %s (%s, %d layers) loaded in %.1f s; its KV cache: %d bytes per token",
                spec.draft_model, weight_format, config.num_layers, loaded.load_seconds,
                config.kv_bytes_per_token(kv_bytes_per_element(kv_dtype, config.head_dim)))
    return ModelDraftProposer("draft_model", loaded.model, kv_caches, None, core.runner.build_batch, block_size,
                              shares_target_cache=False)
