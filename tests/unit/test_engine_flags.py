"""The engine's flags are defined once (engine_flags.py) and every command that builds an
engine takes all of them, each into the same option: `tokios serve`, `generate`, `chat` and
`bench offline`, and the Python LLM by the flags' dests."""

from __future__ import annotations

import argparse
import importlib
import inspect

import pytest

from tokios.engine_flags import (add_engine_arguments, engine_config_from_args, engine_option_names,
                                          engine_options, parse_step_budget)
from tokios.config import EngineConfig, ParallelConfig, SpeculativeConfig
from tokios.errors import InvalidRequestError

# module -> the arguments its command needs besides flags
ENGINE_COMMANDS = {"tokios.commands.serve": [], "tokios.commands.generate": ["a prompt"], "tokios.commands.chat": [],
                   "tokios.tools.bench.offline": []}
# Per-command options that are not the engine's: serve's models, generate's sampling seed, ...
NOT_ENGINE_FLAGS = {"model", "seed"}


def command_parser(module_name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def engine_actions() -> list[argparse.Action]:
    return [action for action in engine_parser()._actions if action.dest != "help"]


def sample_argv(action: argparse.Action) -> list[str]:
    """The flag with a value other than its default."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, list(action.choices)[-1]]
    value = {int: "3", float: "2.5", parse_step_budget: "100"}.get(action.type, "some-value")
    return [flag, value]


@pytest.mark.parametrize("module_name", sorted(ENGINE_COMMANDS))
def test_every_engine_building_command_takes_every_engine_flag(module_name):
    parser = command_parser(module_name)
    options = {option for action in parser._actions for option in action.option_strings}
    engine_flags = {option for action in engine_actions() for option in action.option_strings}
    assert engine_flags - options == set()
    for action in engine_actions():
        argv = sample_argv(action)
        expected = engine_parser().parse_args(argv)
        got = parser.parse_args(ENGINE_COMMANDS[module_name] + argv)
        if action.dest == "dtype" and module_name.endswith("offline"):
            assert got.dtype == expected.dtype  # its own flag: a list of dtypes, one row each
            continue
        assert engine_options(got)[action.dest] == getattr(expected, action.dest), argv


def test_generate_takes_the_flags_it_lacked():
    args = command_parser("tokios.commands.generate").parse_args(
        ["a prompt", "--tensor-parallel-size", "3", "--kv-cache-dtype", "int8", "--speculative-method", "ngram"])
    config = engine_config_from_args(args, model=args.model, seed=args.seed or 0)
    assert config.parallel.tensor_parallel_size == 3
    assert config.cache.kv_cache_dtype == "int8"
    assert config.speculative.method == "ngram"


@pytest.mark.parametrize("module_name", ["tokios.commands.serve", "tokios.commands.generate", "tokios.commands.chat"])
def test_a_command_s_defaults_are_the_engine_s(module_name):
    args = command_parser(module_name).parse_args(ENGINE_COMMANDS[module_name])
    assert engine_config_from_args(args) == EngineConfig()


def test_bench_offline_runs_tokios_as_llm_does():
    args = command_parser("tokios.tools.bench.offline").parse_args([])
    assert engine_options(args, dtype="auto") == {**{name: getattr(engine_parser().parse_args([]), name)
                                                     for name in engine_option_names()}, "max_step_ms": None}


def test_the_flags_are_the_engine_options_and_their_defaults():
    parameters = inspect.signature(EngineConfig.from_options).parameters
    whole_sub_configs = {"speculative_config", "parallel_config"}
    assert set(engine_option_names()) == set(parameters) - NOT_ENGINE_FLAGS - whole_sub_configs
    defaults = engine_parser().parse_args([])
    for name in engine_option_names():
        assert getattr(defaults, name) == parameters[name].default, name
    assert EngineConfig.from_options() == EngineConfig()


def test_llm_takes_every_engine_flag_by_its_dest(monkeypatch):
    import tokios.engine.llm as llm_module

    built = []

    class RecordingCore:
        def __init__(self, config):
            built.append(config)
            self.tokenizer = self.model_config = None

    monkeypatch.setattr(llm_module, "EngineCore", RecordingCore)
    monkeypatch.setattr(llm_module, "OutputProcessor", lambda tokenizer: None)
    args = engine_parser().parse_args(["--tensor-parallel-size", "3", "--speculative-method", "ngram",
                                       "--kv-cache-dtype", "int8", "--threads", "2", "--no-prefix-caching"])
    llm_module.LLM(model="m.gguf", **engine_options(args))
    assert built == [engine_config_from_args(args, model="m.gguf")]
    llm_module.LLM()
    assert built[-1] == EngineConfig.from_options(max_step_ms=None)  # a batch run waits on no stream


def test_a_whole_sub_config_and_an_option_that_disagrees_are_refused():
    config = EngineConfig.from_options(tensor_parallel_size=2, parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert config.parallel.tensor_parallel_size == 2
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size") as caught:
        EngineConfig.from_options(tensor_parallel_size=3, parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert caught.value.param == "parallel_config"
    spec = SpeculativeConfig(method="ngram", enable_adaptive=False)
    assert EngineConfig.from_options(dtype="float32", speculative_config=spec).speculative is spec
    with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
        EngineConfig.from_options(num_speculative_tokens=2, speculative_config=spec)
