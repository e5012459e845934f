"""`tokios plan` end to end: table and JSON, no torch in the process, this-machine cache."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tokios.tools.plan import hardware

_RUN_PLAN_WITHOUT_TORCH = """
import sys
from tokios.cli import main
code = main(sys.argv[1:])
assert "torch" not in sys.modules, "tokios plan imported torch"
sys.exit(code)
"""


def _plan(*args: str, cache_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKIOS_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", _RUN_PLAN_WITHOUT_TORCH, "plan", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_json_for_the_issue_example_without_importing_torch(tmp_path):
    result = _plan("--model", "llama-3-70b", "--hardware", "h100-sxm", "--count", "2",
                   "--weight-bits", "fp16", "--concurrency", "16", "--context", "4096",
                   "--acceptance", "0.8", "--json", cache_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["kv_bytes_per_token"] == 320 * 1024
    assert plan["fits"] is False
    assert round(plan["spec_tokens_per_verify"], 2) == 3.36
    assert any(s["change"].startswith("more devices") for s in plan["suggestions"])


def test_table_for_the_default_model_uses_the_cached_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKIOS_CACHE_DIR", str(tmp_path))
    measurement = {"memory_bytes": 24 * 2**30, "memory_bandwidth": 25e9, "num_cpus": os.cpu_count(),
                   "dtype_to_peak_flops": {"fp32": 70e9, "bf16": 360e9}}
    hardware.save_this_machine(measurement)
    result = _plan("--concurrency", "4", cache_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "measuring" not in result.stderr  # the cache was used
    assert "this-machine (measured)" in result.stdout
    assert "25 GB/s" in result.stdout
    assert re.search(r"^fits\s+yes", result.stdout, re.MULTILINE)


def test_bad_argument_is_one_line_naming_the_field(tmp_path):
    result = _plan("--model", "llama-3-8b", "--hardware", "l4", "--count", "4", "--tp", "3",
                   cache_dir=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "tokios plan: error: tp: 3 must divide count 4 (each replica is a whole tensor-parallel group)"]


def test_cache_from_another_machine_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKIOS_CACHE_DIR", str(tmp_path))
    hardware.save_this_machine({"memory_bytes": 1, "memory_bandwidth": 1.0,
                                "dtype_to_peak_flops": {"fp32": 1.0}})
    assert hardware.read_cached_this_machine() is not None
    record = json.loads(hardware.cache_path().read_text())
    record["identity"]["hostname"] = "some-other-host"
    hardware.cache_path().write_text(json.dumps(record))
    assert hardware.read_cached_this_machine() is None


def test_this_machine_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKIOS_CACHE_DIR", str(tmp_path))
    measured = hardware.measure_this_machine(quick=True)  # real microbenchmarks, small sizes
    assert measured.is_measured and measured.memory_bandwidth > 0
    assert set(measured.dtype_to_peak_flops) >= {"fp32", "bf16"}
    assert hardware.load_hardware("this-machine") == measured


def test_unknown_hardware_is_rejected():
    from tokios.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="hardware"):
        hardware.load_hardware("tpu-v9")
