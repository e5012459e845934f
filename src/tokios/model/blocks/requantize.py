"""Write a GGUF file whose 2-D weights are requantized into other block types, tensor by tensor,
with our own quantizers (blocks/quantize.py); everything else (metadata, norms) is copied.

Used by the tests to make files of every type from the default model, and of random-weight
models whose rows are multiples of 256 (so that real K-quant tensors run, which the default
model's 576-wide rows never allow). `mostly_q4_k_m` mimics how llama.cpp's Q4_K_M chooses a type
per tensor, so a test file mixes four or five types as a downloaded one does; `mostly_mxfp4_moe`
how its MXFP4_MOE does (a gpt-oss file as users get it: a random checkpoint converts with float
experts, convert_hf_to_gguf.py writes MXFP4 only from an MXFP4 checkpoint).

Weights only (names ending in .weight, 2-D, or 3-D stacked experts, quantized row by row);
biases, norms and the like stay float32, as llama-quantize leaves them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter

from tokios.gguf_file import GGUFFile
from tokios.model.blocks.quantize import K_QUANT_TYPES, quantize
from tokios.model.quant import dequantize

# What llama.cpp stores instead of a K-quant when a row is not a whole number of 256-weight blocks.
K_QUANT_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}

TypeChooser = Callable[[str, tuple[int, ...], int], T]  # (tensor name, shape, num_layers) -> type


def uniform(ggml_type: T) -> TypeChooser:
    """Every 2-D weight in `ggml_type`."""
    return lambda name, shape, num_layers: ggml_type


def mostly_q4_k_m(name: str, shape: tuple[int, int], num_layers: int) -> T:
    """llama.cpp's Q4_K_M choice: Q6_K for the embedding / output and for attn_v and ffn_down in the
    first and last eighth of the layers and every third layer between; Q4_K elsewhere."""
    if name in ("token_embd.weight", "output.weight"):
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        uses_more_bits = layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2
        return T.Q6_K if uses_more_bits else T.Q4_K
    return T.Q4_K


def mostly_mxfp4_moe(name: str, shape: tuple[int, ...], num_layers: int) -> T:
    """llama.cpp's MXFP4_MOE choice: the stacked experts (3-D) in MXFP4, every other weight in
    Q8_0, the router (ffn_gate_inp) left float32 as llama-quantize leaves it."""
    if ".ffn_gate_inp." in name:
        return T.F32
    return T.MXFP4 if len(shape) == 3 else T.Q8_0


def storable_type(ggml_type: T, shape: tuple[int, ...]) -> T:
    """`ggml_type`, or llama.cpp's fallback where the rows do not fit its blocks: a K-quant's
    32-weight cousin, and F16 where rows are not even whole 32-weight blocks."""
    if ggml_type in K_QUANT_TYPES and shape[-1] % 256:
        ggml_type = K_QUANT_FALLBACK[ggml_type]
    if ggml_type not in (T.F32, T.F16) and shape[-1] % 32:
        return T.F16
    return ggml_type


def copy_metadata(source: GGUFFile, writer: GGUFWriter, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Every key of `source` into `writer` with its stored type, but the architecture (the writer
    adds it), the alignment (the writer's own) and keys starting with one of `skip_prefixes`."""
    for key, value in source.metadata.items():
        if key.startswith(("general.architecture", "general.alignment") + skip_prefixes):
            continue
        value_type, element_type = source.value_types[key]
        sub_type = GGUFValueType(element_type) if element_type is not None else None
        writer.add_key_value(key, value, GGUFValueType(value_type), sub_type=sub_type)


def requantize_gguf(source: str, destination: str, choose: TypeChooser) -> dict[str, T]:
    """Write `destination` from `source` with each 2-D weight in the type `choose` names (made
    storable); returns tensor name -> type written."""
    reader = GGUFFile(source)
    architecture = reader.architecture
    num_layers = int(reader.metadata[f"{architecture}.block_count"])
    writer = GGUFWriter(destination, architecture)
    copy_metadata(reader, writer)
    written: dict[str, T] = {}
    for tensor in reader.tensors.values():
        shape = tensor.shape
        weights = dequantize(reader.raw_bytes(tensor.name), tensor.ggml_type, shape, tensor.name).numpy()
        is_weight = tensor.name.endswith(".weight") and len(shape) in (2, 3)
        ggml_type = storable_type(choose(tensor.name, shape, num_layers), shape) if is_weight else T.F32
        if ggml_type in (T.F32, T.F16):
            writer.add_tensor(tensor.name, weights.astype(np.float16 if ggml_type == T.F16 else np.float32))
        else:
            blocks = quantize(weights.reshape(-1, shape[-1]), ggml_type).reshape(*shape[:-1], -1)
            writer.add_tensor(tensor.name, blocks, raw_dtype=ggml_type)
        written[tensor.name] = ggml_type
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written
