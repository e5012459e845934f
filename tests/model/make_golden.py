"""Regenerate the golden files (tests/data/golden/*.json, described in golden.py) with transformers.

    .venv/bin/python tests/model/make_golden.py            # every model
    .venv/bin/python tests/model/make_golden.py gemma3     # one: smollm2, gemma3 or qwen25

Run it when a model file, the prompts or texts of the tests that read a golden file, or the
installed transformers changes what the live comparisons (test_parity.py's
`test_golden_file_is_what_transformers_computes`, test_families.py) see; commit the files it writes. It takes a
minute or two (transformers loads Gemma 3 in about 30 s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

from golden import golden_path, logits_summary, model_file_key, rounded
from reference import (load_reference_model, load_reference_tokenizer, perplexity_from_logits, prompt_token_ids,
                       reference_greedy, reference_logits)
from tokios.model_files import default_model_path, gemma3_model_path, qwen25_model_path
from tokios.tokenizer import Tokenizer

PERPLEXITY_TEXT = Path(__file__).parent.parent / "data" / "perplexity_text.txt"


def header(path: Path) -> dict:
    return {"model_file": model_file_key(path), "transformers": transformers.__version__,
            "torch": torch.__version__, "dtype": "float32", "made_by": "tests/model/make_golden.py"}


def sequence(model, prompt_ids: list[int], num_tokens: int) -> dict:
    continuation = reference_greedy(model, prompt_ids, num_tokens)
    return {"prompt_ids": prompt_ids, "greedy_ids": continuation,
            **logits_summary(reference_logits(model, prompt_ids + continuation))}


def perplexity(model, token_ids: list[int]) -> dict:
    return {"token_ids": token_ids,
            "value": perplexity_from_logits(reference_logits(model, token_ids), token_ids)}


def smollm2() -> dict:
    from test_parity import NUM_TOKENS, PROMPTS

    path = default_model_path()
    model, tokenizer = load_reference_model(path), Tokenizer.from_gguf_file(path)
    return {**header(path),
            "sequences": {name: sequence(model, prompt_token_ids(tokenizer, PROMPTS[name]), NUM_TOKENS)
                          for name in sorted(PROMPTS)},
            "perplexity": perplexity(model, tokenizer.encode(PERPLEXITY_TEXT.read_text(encoding="utf-8")))}


def gemma3() -> dict:
    from test_gemma3 import GEMMA_CORPUS, LONG_PROMPT_TOKENS, NUM_TOKENS, PROMPTS, long_prompt_text

    path = gemma3_model_path()
    model, tokenizer = load_reference_model(path), Tokenizer.from_gguf_file(path)
    long_ids = tokenizer.encode(long_prompt_text())[:LONG_PROMPT_TOKENS]
    logits = reference_logits(model, long_ids).double()
    next_ids = torch.tensor(long_ids[1:])
    reference_tokenizer = load_reference_tokenizer(path)
    return {**header(path),
            "sequences": {str(index): sequence(model, tokenizer.encode(prompt), NUM_TOKENS)
                          for index, prompt in enumerate(PROMPTS)},
            "long_prompt": {"prompt_ids": long_ids,
                            "next_token_logits": rounded(logits[:-1].gather(1, next_ids[:, None]).squeeze(1)),
                            "top_logits": rounded(logits.max(-1).values),
                            "logsumexp": rounded(torch.logsumexp(logits, dim=-1)),
                            "greedy_ids": reference_greedy(model, long_ids, 8)},
            "perplexity": perplexity(model, tokenizer.encode(PERPLEXITY_TEXT.read_text(encoding="utf-8"))),
            "tokenizer": [{"text": text, "ids": reference_tokenizer(text).input_ids,
                           "ids_without_special_tokens": reference_tokenizer(text, add_special_tokens=False).input_ids}
                          for text in GEMMA_CORPUS]}


def qwen25() -> dict:
    from test_qwen25 import NUM_TOKENS, PROMPTS

    path = qwen25_model_path()
    model, tokenizer = load_reference_model(path), Tokenizer.from_gguf_file(path)
    reference_tokenizer = load_reference_tokenizer(path)
    return {**header(path),
            "sequences": {name: sequence(model, prompt_token_ids(tokenizer, PROMPTS[name]), NUM_TOKENS)
                          for name in sorted(PROMPTS)},
            "chat_text": reference_tokenizer.apply_chat_template(PROMPTS["chat_reverse"], add_generation_prompt=True,
                                                                 tokenize=False)}


MAKERS = {"smollm2": smollm2, "gemma3": gemma3, "qwen25": qwen25}


def main(names: list[str]) -> None:
    for name in names or list(MAKERS):
        golden = MAKERS[name]()
        path = golden_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(golden, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
