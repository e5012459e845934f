"""The engine's flags, defined once for every command that builds an engine.

`tokios serve`, `generate`, `chat` and `bench offline` call add_engine_arguments(parser) and turn
the parsed flags into an engine with engine_config_from_args(args) (an EngineConfig) or
engine_options(args) (LLM's keywords). A flag's dest is the name of the same option in
config.py's EngineConfig.from_options, which LLM(**options) takes too, and its default is read
from there: a new engine option is one parameter there and one flag here, and every command and
the Python API have it.

--model and --seed stay each command's own: serve takes several models, generate's seed also
seeds its sampling, bench offline's picks its prompts. Flags that only make sense for serving (the
network, several models, API keys) stay in server/cli.py. No torch here: building a parser is cheap.
"""

from __future__ import annotations

import argparse
import inspect
import math

from tokios.config import SPECULATIVE_METHODS, SUPPORTED_KV_CACHE_DTYPES, EngineConfig
from tokios.distributed.cli import add_parallel_arguments

_DEFAULTS = {name: parameter.default
             for name, parameter in inspect.signature(EngineConfig.from_options).parameters.items()}


def parse_step_budget(text: str) -> float | str | None:
    """--max-step-ms: a positive number of milliseconds, auto, or off (None)."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of milliseconds, auto or off, got {text!r}")
    return value


def _step_budget_text(value: float | str | None) -> str:
    return "off" if value is None else value if isinstance(value, str) else f"{value:g}"


def add_engine_arguments(parser: argparse.ArgumentParser, *, own: tuple[str, ...] = (),
                         defaults: dict[str, object] | None = None) -> None:
    """The engine's flags, in groups. own: dests the command defines itself with a meaning of
    its own (bench offline's --dtype is a list, one row each); defaults: the command's own
    defaults (bench offline mirrors LLM's, which cuts no prefill for a step budget)."""
    default = {**_DEFAULTS, **(defaults or {})}

    def add(group, *flags: str, dest: str, **kwargs) -> None:
        if dest not in own:
            group.add_argument(*flags, dest=dest, default=default[dest], **kwargs)

    load = parser.add_argument_group("engine: loading the model")
    add(load, "--dtype", dest="dtype", help="how weights are held: auto (the file as stored on a CPU, bfloat16 "
                                            "on CUDA), float32, bfloat16, int8 or int4 (default auto)")
    add(load, "--device", dest="device", help="auto (CUDA when present), cpu or cuda[:N] (default auto)")
    add(load, "--threads", dest="num_threads", type=int, metavar="N",
        help="CPU threads of the engine (default: the physical cores; fewer when several engines share a machine)")
    add(load, "--chat-template", dest="chat_template",
        help="a Jinja chat template file, or a built-in: chatml, gemma (default: the model file's own; a "
             "pretrained model has none)")
    cache = parser.add_argument_group("engine: KV cache")
    add(cache, "--kv-cache-memory", dest="kv_cache_memory",
        help=f"memory for the KV cache, e.g. 512MiB, 2GiB (default {default['kv_cache_memory']})")
    add(cache, "--kv-cache-dtype", dest="kv_cache_dtype", choices=list(SUPPORTED_KV_CACHE_DTYPES),
        help="KV cache element type; auto = float32 for float32 weights, else bfloat16; int8 (per token and head "
             "scales) holds 1.9x the tokens of bfloat16 in the same memory")
    add(cache, "--kv-cache-disk", dest="kv_cache_disk", metavar="DIR",
        help="keep the prefix cache's evicted blocks, and all of it at shutdown, in DIR; a prompt whose prefix "
             "is there loads it instead of recomputing, after a restart too")
    add(cache, "--kv-cache-disk-size", dest="kv_cache_disk_size", metavar="SIZE",
        help=f"the most DIR may hold; least recently used blocks go first (default {default['kv_cache_disk_size']})")
    add(cache, "--block-size", dest="block_size", type=int,
        help=f"tokens per KV block (default {default['block_size']})")
    add(cache, "--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
        help="disable prefix caching")
    batch = parser.add_argument_group("engine: batching")
    add(batch, "--max-num-seqs", dest="max_num_seqs", type=int,
        help=f"requests running at once (default {default['max_num_seqs']})")
    add(batch, "--max-num-batched-tokens", dest="max_num_batched_tokens", type=int,
        help=f"token budget per step (default {default['max_num_batched_tokens']})")
    add(batch, "--max-step-ms", dest="max_step_ms", type=parse_step_budget, metavar="MS|auto|off",
        help="while streams decode, cut prefill chunks so a step stays within this many ms; auto: prefill may "
             "take as long as the step's decodes (a long prompt at most doubles the others' inter-token "
             "latency, and waits longer itself); off: the token budget alone "
             f"(default {_step_budget_text(default['max_step_ms'])})")
    add(batch, "--no-prefill-layer-slices", dest="prefill_layer_slices", action="store_false",
        help="under --max-step-ms, keep every prompt chunk whole: by default, once the step budget holds too "
             "few of a long prompt's tokens, its chunks run through some layers a step")
    add(batch, "--max-model-len", dest="max_model_len", type=int, help="context limit (default: the model's)")
    spec = parser.add_argument_group("engine: speculative decoding (docs/speculative.md)")
    add(spec, "--speculative-method", dest="speculative_method", choices=["none", *SPECULATIVE_METHODS],
        help="default method for requests that do not choose (default: none)")
    add(spec, "--num-speculative-tokens", dest="num_speculative_tokens", type=int,
        help=f"proposed tokens per verification, the most a request may ask "
             f"(default {default['num_speculative_tokens']})")
    add(spec, "--draft-model", dest="draft_model", help="draft model file or directory (tokenizer must match)")
    add(spec, "--self-draft-layers", dest="self_draft_num_layers", type=int, metavar="L",
        help=f"target layers the self-draft runs before exiting (default {default['self_draft_num_layers']})")
    add_parallel_arguments(parser)  # shared with `tokios worker`


def engine_option_names() -> list[str]:
    """The dests of the engine's flags: EngineConfig.from_options's names less the per-command ones."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(parser)
    return list(vars(parser.parse_args([])))


def engine_options(args: argparse.Namespace, **overrides) -> dict[str, object]:
    """LLM's (and EngineConfig.from_options's) keywords from parsed engine flags; a dest the
    command defines itself (add_engine_arguments's own) comes from overrides."""
    return {**{name: getattr(args, name) for name in engine_option_names()}, **overrides}


def engine_config_from_args(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The EngineConfig of parsed engine flags; overrides: the command's own options (model, seed)."""
    return EngineConfig.from_options(**engine_options(args, **overrides))
