"""What a gpt-oss file says beyond the Llama shape and its experts (model/shape.py reads those):
which layers attend through a sliding window. No torch here: read by model/shape.py, the one
description of a model file.

GGUF (convert_hf_to_gguf.py's GptOssModel): `gpt-oss.attention.sliding_window` and no layer
pattern; llama.cpp then has even layers slide and odd ones attend fully (its period 2), which is
GptOssConfig's default layer_types. A Hugging Face directory: config.json's layer_types.

What a gpt-oss file cannot say, and this code does not honour but refuses by name: a sliding
layers' RoPE base of their own, an expert SwiGLU other than alpha 1.702 and limit 7.0 (the GGUF
has no key for them: llama.cpp's constants, moe.ExpertActivation's defaults), and a checkpoint
whose experts are still MXFP4 blocks (convert_hf_to_gguf.py turns it into a GGUF file).
"""

from __future__ import annotations

from typing import Any

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model.gemma3_metadata import sliding_layer_windows

ARCHITECTURE = "gpt-oss"
SLIDING_WINDOW_PATTERN = 2
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def gpt_oss_fields(metadata: dict[str, Any], path: str, num_layers: int) -> dict[str, Any]:
    """A gpt-oss GGUF's per-layer sliding windows."""
    arch = ARCHITECTURE
    swa_base = metadata.get(f"{arch}.rope.freq_base_swa")
    if swa_base is not None and float(swa_base) != float(metadata.get(f"{arch}.rope.freq_base", swa_base)):
        raise UnsupportedError(f"{path}: {arch}.rope.freq_base_swa {swa_base} (a RoPE base of the sliding layers' "
                               "own) is not supported")
    return {"layer_windows": sliding_layer_windows(metadata, arch, path, num_layers, SLIDING_WINDOW_PATTERN)}


def gpt_oss_hf_fields(hf: dict[str, Any], path: str) -> dict[str, Any]:
    """A gpt-oss config.json's per-layer sliding windows (layer_types)."""
    quantization = (hf.get("quantization_config") or {}).get("quant_method")
    if quantization is not None:
        raise UnsupportedError(f"{path}: a {quantization} checkpoint directory is not supported; convert it with "
                               "llama.cpp's convert_hf_to_gguf.py (which keeps MXFP4 experts) and load the GGUF file")
    for key, expected in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        if float(hf.get(key, expected)) != expected:
            raise UnsupportedError(f"{path}: {key} {hf[key]} is not supported (gpt-oss's is {expected})")
    layer_types = hf.get("layer_types")
    num_layers = int(hf["num_hidden_layers"])
    if layer_types is None or len(layer_types) != num_layers:
        raise ModelLoadError(f"{path}: layer_types must name each of the {num_layers} layers' attention")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise UnsupportedError(f"{path}: layer_types {unknown} are not supported "
                               "(sliding_attention, full_attention)")
    window = int(hf["sliding_window"])
    return {"layer_windows": tuple(window if kind == "sliding_attention" else None for kind in layer_types)}
