"""Engine configuration: one EngineConfig made of small frozen sub-configs.

Every sub-config validates itself in __post_init__ and raises InvalidRequestError naming the
field, so a bad command-line flag or LLM(...) argument fails before anything is loaded.
EngineConfig.from_options builds one from the flat option names that the engine flags
(engine_flags.py) and LLM share. ModelConfig is not user-set: the loaders derive it
from the model file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tokios.errors import InvalidRequestError
from tokios.kv_cache.dtypes import ENGINE_KV_DTYPES, kv_bytes_per_token

SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "int8", "int4")
SUPPORTED_KV_CACHE_DTYPES = ("auto", *ENGINE_KV_DTYPES)
# What "auto" resolves to on each device; chosen by measurement (docs/benchmarks.md).
# "stored": every tensor as the file holds it (GGUF blocks on the quantized kernels, dense
# tensors in their own precision); conversions are only ever explicit.
AUTO_DTYPE_BY_DEVICE = {"cpu": "stored", "cuda": "bfloat16"}

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
               "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str | int, *, field_name: str = "size") -> int:
    """'2GiB' -> 2147483648. Plain integers are bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _SIZE_UNITS:
        raise InvalidRequestError(
            f"{field_name} must be a size like 512MiB or 2GiB, got {text!r}", param=field_name)
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


_DURATION_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str | int | float, *, field_name: str = "duration") -> float:
    """Ollama's keep-alive forms: '5m', '1h30m', '30s', '250ms', or a number of seconds; a
    negative value means forever (returned as -1)."""
    if isinstance(value, bool):
        raise InvalidRequestError(f"{field_name} must be a duration like 5m or a number of seconds, got {value!r}",
                                  param=field_name)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        parts = re.findall(r"([0-9]*\.?[0-9]+)\s*(ms|h|m|s|)", text.lstrip("+-"))
        if not text.lstrip("+-") or "".join(f"{number}{unit}" for number, unit in parts) != \
                text.lstrip("+-").replace(" ", ""):
            raise InvalidRequestError(f"{field_name} must be a duration like 5m, 1h or 30s, or a number of seconds, "
                                      f"got {value!r}", param=field_name)
        seconds = sign * sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise InvalidRequestError(f"{field_name} must be finite, got {value!r}", param=field_name)
    return -1.0 if seconds < 0 else seconds


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(f"{field_name} {message}", param=field_name)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer, as the model code reads them: made by
    model/loader.py from the file's ModelShape (model/shape.py)."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-5
    num_rope_dims: int | None = None  # leading dimensions of each head that RoPE rotates; None: all
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    name: str = ""
    # Per layer: the sliding window in tokens (the layer attends to the last `window` positions,
    # its own included), or None for full attention. None: every layer is full.
    layer_windows: tuple[int | None, ...] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3), if it differs
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Per layer: (KV heads, head_dim), where layers differ (Gemma 4's full-attention layers have
    # wider heads); a layer's query heads have its head_dim too. None: every layer is
    # (num_kv_heads, head_dim).
    layer_kv_shapes: tuple[tuple[int, int], ...] | None = None
    # Per layer: the layer whose K/V it attends over: itself, or an earlier layer whose cache it
    # reads without computing or storing K/V of its own (Gemma 4's last layers). None: each its own.
    kv_source_layers: tuple[int, ...] | None = None
    # Mixture of experts (model/moe.py), as ModelShape describes it; num_experts 0: dense.
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # How a token's experts are chosen and weighted (model/moe.py Routing): the router logits'
    # scoring, whether the top k weights are renormalised to sum to 1, a factor on them.
    expert_scoring: str = "softmax"
    expert_normalize_top_k: bool = False
    expert_weights_scale: float = 1.0

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        return None if self.layer_windows is None else self.layer_windows[layer]

    def kv_shape_of(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of the layer."""
        return (self.num_kv_heads, self.head_dim) if self.layer_kv_shapes is None else self.layer_kv_shapes[layer]

    def kv_source_of(self, layer: int) -> int:
        return layer if self.kv_source_layers is None else self.kv_source_layers[layer]

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that store K/V (the others read an earlier layer's)."""
        return tuple(layer for layer in range(self.num_layers) if self.kv_source_of(layer) == layer)

    def kv_bytes_per_token(self, bytes_per_element: float) -> int:
        """K and V of one token in every layer that stores them (what a context shorter than every
        window costs). bytes_per_element: kv_cache/dtypes.py kv_bytes_per_element (an int8
        head's scale included)."""
        return round(sum(kv_bytes_per_token(1, *self.kv_shape_of(layer), bytes_per_element)
                         for layer in self.kv_layers))


@dataclass(frozen=True)
class LoadConfig:
    model: str | None = None  # None: the default model
    dtype: str = "auto"
    device: str = "auto"
    num_threads: int | None = None  # None: physical cores
    # A Jinja file or a built-in name (tokenizer/chat_template.py) replacing the file's template.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        _require(self.dtype in SUPPORTED_DTYPES, "dtype", f"must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        _require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device",
                 f"must be auto, cpu or cuda[:N], got {self.device!r}")
        _require(self.num_threads is None or self.num_threads >= 1, "num_threads", "must be >= 1")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: int = 512 * 1024**2
    enable_prefix_caching: bool = True
    # auto: float32 for float32 weights, bfloat16 otherwise (model/dtypes.py kv_cache_dtype)
    kv_cache_dtype: str = "auto"
    # The prefix cache's disk tier (kv_cache/disk_tier.py): a directory and its size limit.
    kv_cache_disk: str | None = None
    kv_cache_disk_bytes: int = 4 * 1024**3

    def __post_init__(self) -> None:
        _require(self.kv_cache_dtype in SUPPORTED_KV_CACHE_DTYPES, "kv_cache_dtype",
                 f"must be one of {SUPPORTED_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _require(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "block_size",
                 f"must be a power of two from 1 to 128, got {self.block_size}")
        _require(self.kv_cache_memory_bytes >= 1024**2, "kv_cache_memory",
                 f"must be at least 1MiB, got {self.kv_cache_memory_bytes} bytes")
        _require(self.kv_cache_disk_bytes >= 1024**2, "kv_cache_disk_size",
                 f"must be at least 1MiB, got {self.kv_cache_disk_bytes} bytes")
        _require(self.kv_cache_disk is None or self.enable_prefix_caching, "kv_cache_disk",
                 "needs prefix caching (it is the prefix cache's disk tier)")


DEFAULT_MAX_STEP_MS = 250.0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own context length
    # A step's time budget while it carries decodes (fair chunked prefill, scheduler.py):
    # milliseconds, "auto" (prefill gets the decodes' own time), or None (the token budget alone).
    # 250 ms: the measured trade in docs/benchmarks.md ("Fairness"): a stall a quarter of what
    # the token budget alone gives, for 40% more TTFT on a 5,500-token prompt; "auto" keeps
    # steps within 2x but multiplies that prompt's TTFT by 5 on a CPU.
    max_step_ms: float | str | None = DEFAULT_MAX_STEP_MS
    # Under a step budget, a long prompt's chunk may run through some layers a step (layer
    # slices, scheduler.py) once the budget holds too few of its tokens for all of them.
    prefill_layer_slices: bool = True

    def __post_init__(self) -> None:
        _require(self.max_step_ms is None or self.max_step_ms == "auto"
                 or (isinstance(self.max_step_ms, (int, float)) and self.max_step_ms > 0), "max_step_ms",
                 f"must be a positive number of milliseconds, 'auto' or None, got {self.max_step_ms!r}")
        _require(1 <= self.max_num_seqs <= 4096, "max_num_seqs", f"must be in 1..4096, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 f"must be >= 1, got {self.max_num_batched_tokens}")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len",
                 f"must be >= 2, got {self.max_model_len}")


SPECULATIVE_METHODS = ("ngram", "self_draft", "draft_model")
MAX_NUM_SPECULATIVE_TOKENS = 16


def check_speculative_method(method: object, param: str) -> str | None:
    """A speculative method's name (the engine's default or a request's), or None for off."""
    if method in (None, "none", "off"):
        return None
    if method not in SPECULATIVE_METHODS:
        raise InvalidRequestError(f"{param} must be one of {('none',) + SPECULATIVE_METHODS}, got {method!r}",
                                  param=param)
    return method


def check_num_speculative_tokens(value: object, param: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_NUM_SPECULATIVE_TOKENS:
        raise InvalidRequestError(f"{param} must be an integer in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {value!r}",
                                  param=param)
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (speculative/, docs/speculative.md): the method requests get when
    they do not choose (a request's own choice is sampling_params.SpeculativeParams), how many
    tokens a verification may take, and the proposers' settings."""

    method: str | None = None  # the default for requests that do not choose; None: off
    num_speculative_tokens: int = 4  # k: proposed tokens per verification, the most a request may ask
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    self_draft_num_layers: int = 6  # early exit after this many of the target's layers
    draft_model: str | None = None  # path of a separate draft model (method draft_model)
    draft_dtype: str = "auto"
    enable_adaptive: bool = True  # adapt k to the acceptance rate; switch off below break-even
    # Cost of one extra verify row, as a fraction of a plain decode step (the c of the break-even
    # formula adds the draft's measured cost to it). benchmarks/speculative_speed.py measures the
    # fused kernels alone at 0.18-0.25 on the default model in int4 on 2 cores; a whole engine
    # step also pays a fixed cost that speculation amortizes, so the default sits a little below.
    verify_token_cost: float = 0.15

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", check_speculative_method(self.method, "speculative_method"))
        check_num_speculative_tokens(self.num_speculative_tokens, "num_speculative_tokens")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise InvalidRequestError(f"ngram sizes must satisfy 1 <= ngram_min_n <= ngram_max_n, got "
                                      f"{self.ngram_min_n} and {self.ngram_max_n}", param="ngram_max_n")
        if self.self_draft_num_layers < 1:
            raise InvalidRequestError(f"self_draft_num_layers must be >= 1, got {self.self_draft_num_layers}",
                                      param="self_draft_num_layers")
        if self.method == "draft_model" and not self.draft_model:
            raise InvalidRequestError("speculative_method draft_model needs --draft-model PATH", param="draft_model")
        if not 0.0 <= self.verify_token_cost < 1.0:
            raise InvalidRequestError(f"verify_token_cost must be in [0, 1), got {self.verify_token_cost}",
                                      param="verify_token_cost")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor x pipeline parallel over worker processes (tokios.distributed, docs/scale-out.md).
    The group meets at master_addr:master_port (and the front listens one port above); with
    nnodes > 1 the other machines run `tokios worker` with their node_rank."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one machine only)
    nnodes: int = 1
    node_rank: int = 0
    # A collective that waits this long on a silent peer raises (a hung or unreachable rank).
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _require(1 <= self.tensor_parallel_size <= 64, "tensor_parallel_size",
                 f"must be in 1..64, got {self.tensor_parallel_size}")
        _require(1 <= self.pipeline_parallel_size <= 64, "pipeline_parallel_size",
                 f"must be in 1..64, got {self.pipeline_parallel_size}")
        _require(self.nnodes >= 1, "nnodes", f"must be >= 1, got {self.nnodes}")
        _require(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        _require(self.master_port is None or 1 <= self.master_port < 65535, "master_port",
                 f"must be in 1..65534 (the front listens one above), got {self.master_port}")
        _require(self.nnodes == 1 or self.master_port is not None, "master_port",
                 "is needed when the group spans machines (they must all meet at the same port)")
        _require(self.timeout_s > 0, "timeout_s", f"must be positive, got {self.timeout_s}")
        _require(self.world_size % self.nnodes == 0, "nnodes",
                 f"must divide the {self.world_size} ranks evenly, got {self.nnodes}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_ranks(self) -> range:
        """The ranks of this machine (node_rank): machines hold consecutive ranks."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.parallel.world_size > 1:
            _require(self.cache.kv_cache_disk is None, "kv_cache_disk",
                     "is not available with tensor or pipeline parallel: the ranks hold the cache's blocks")
            _require(self.parallel.node_rank == 0, "node_rank",
                     "of the server is 0; the other machines run `tokios worker --node-rank N`")

    @classmethod
    def from_options(cls, *, model: str | None = None, dtype: str = "auto", device: str = "auto",
                     num_threads: int | None = None, chat_template: str | None = None,
                     kv_cache_memory: str | int = "512MiB", kv_cache_dtype: str = "auto",
                     kv_cache_disk: str | None = None, kv_cache_disk_size: str | int = "4GiB", block_size: int = 16,
                     enable_prefix_caching: bool = True, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                     max_model_len: int | None = None, max_step_ms: float | str | None = DEFAULT_MAX_STEP_MS,
                     prefill_layer_slices: bool = True, speculative_method: str | None = None,
                     num_speculative_tokens: int = 4, draft_model: str | None = None, self_draft_num_layers: int = 6,
                     tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1, master_addr: str = "127.0.0.1",
                     master_port: int | None = None, nnodes: int = 1, dist_timeout: float = 60.0,
                     speculative_config: SpeculativeConfig | None = None,
                     parallel_config: ParallelConfig | None = None, seed: int = 0) -> EngineConfig:
        """The engine's options as one flat set of names: the engine flags' dests
        (engine_flags.py) and LLM's keywords. Sizes may be strings (512MiB).
        speculative_config / parallel_config give a whole sub-config instead (with the settings
        that have no flag: n-gram sizes, adaptive k, node_rank); an option of the same group may
        then only repeat what the sub-config says."""
        speculative = SpeculativeConfig(method=speculative_method, num_speculative_tokens=num_speculative_tokens,
                                        draft_model=draft_model, self_draft_num_layers=self_draft_num_layers)
        parallel = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                  pipeline_parallel_size=pipeline_parallel_size, master_addr=master_addr,
                                  master_port=master_port, nnodes=nnodes, timeout_s=dist_timeout)
        if speculative_config is None:
            speculative = replace(speculative, draft_dtype=dtype)  # a draft model is held as the target is
        else:
            _require_same_or_default(speculative, speculative_config, "speculative_config")
            speculative = speculative_config
        if parallel_config is not None:
            _require_same_or_default(parallel, parallel_config, "parallel_config")
            parallel = parallel_config
        return cls(
            load=LoadConfig(model=model, dtype=dtype, device=device, num_threads=num_threads,
                            chat_template=chat_template),
            cache=CacheConfig(block_size=block_size,
                              kv_cache_memory_bytes=parse_size(kv_cache_memory, field_name="kv_cache_memory"),
                              enable_prefix_caching=enable_prefix_caching, kv_cache_dtype=kv_cache_dtype,
                              kv_cache_disk=kv_cache_disk,
                              kv_cache_disk_bytes=parse_size(kv_cache_disk_size, field_name="kv_cache_disk_size")),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, max_step_ms=max_step_ms,
                                      prefill_layer_slices=prefill_layer_slices),
            speculative=speculative, parallel=parallel, seed=seed)


def _require_same_or_default(from_options, given, param: str) -> None:
    """`given` (a whole sub-config) wins; an option that set the same field otherwise must agree."""
    default = type(given)()
    differing = [f.name for f in fields(given) if getattr(from_options, f.name) != getattr(default, f.name)
                 and getattr(from_options, f.name) != getattr(given, f.name)]
    _require(not differing, param, f"and the options {differing} disagree: give each setting once")
