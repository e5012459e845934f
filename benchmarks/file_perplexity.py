"""Perplexity of tokios --dtype auto (each file as stored) against transformers float32 on the
same GGUF files, over the perplexity gate's ~1,000-token text; one line per file with the
engine's weight summary (tensors per block type).

    python benchmarks/file_perplexity.py ~/.cache/tokios/peers/models/*.gguf
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "model"))

from reference import engine_perplexity, perplexity_from_logits, reference_logits  # noqa: E402


def main(paths: list[str]) -> None:
    import transformers

    from tokios.engine import LLM

    text = (ROOT / "tests" / "data" / "perplexity_text.txt").read_text(encoding="utf-8")
    for name in paths:
        path = Path(name)
        llm = LLM(model=str(path), kv_cache_memory="64MiB")
        token_ids = llm.tokenizer.encode(text)
        ours = engine_perplexity(llm, token_ids)
        summary = llm.core.model.weight_summary()
        del llm
        gc.collect()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        reference = perplexity_from_logits(reference_logits(model, token_ids), token_ids)
        del model
        gc.collect()
        print(f"{path.name}: tokios {ours:.4f}, transformers {reference:.4f}, gap {(ours - reference) / reference:+.3%} "
              f"| {summary}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
