"""`from tokios import LLM, SamplingParams` (vLLM's and SGLang's spelling): the same objects as
tokios.engine.LLM and tokios.sampling_params.SamplingParams, imported only when first asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tokios


def test_top_level_names_are_the_engine_s():
    from tokios import LLM, SamplingParams
    from tokios.engine import LLM as EngineLLM
    from tokios.sampling_params import SamplingParams as ModuleSamplingParams

    assert LLM is EngineLLM
    assert SamplingParams is ModuleSamplingParams
    assert {"LLM", "SamplingParams", "__version__"} <= set(tokios.__all__)
    assert {"LLM", "SamplingParams"} <= set(dir(tokios))


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        getattr(tokios, "no_such_name")
    with pytest.raises(ImportError, match="no_such_name"):
        exec("from tokios import no_such_name", {})


@pytest.mark.parametrize("statement", ["import tokios", "import tokios.cli", "import tokios.tools.plan.cli",
                                       "from tokios import __version__"])
def test_importing_tokios_does_not_import_torch(statement):
    script = f"{statement}\nimport sys\nassert 'torch' not in sys.modules, 'torch was imported'\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
