"""Golden files: what transformers computes in float32 on a model file, stored in the repository
(tests/data/golden/<name>.json) so that most model tests compare against it without loading
transformers. make_golden.py writes them. Live transformers runs on every test run too: on the
default model, test_parity.py recomputes its golden file and fails if they no longer agree; and
every architecture is compared live on a tiny model converted by llama.cpp's script
(test_families.py), so a transformers change in an architecture shows there.

A golden file is keyed to its model file by name, size and sha256: a different file fails the
test that reads it, naming the command that regenerates it.

What a file holds (all float32 results, rounded to DECIMALS places, far below every tolerance
that compares against them):
- "sequences": per prompt, its token ids, transformers' greedy continuation (generate(), EOS
  ignored) and, at every position of prompt plus continuation, the top TOP_K logits with their
  ids and the logsumexp over the whole vocabulary (which moves with any logit that moves);
- "long_prompt" (Gemma 3): a prompt's ids, at every position the logit of the next token, the
  largest logit and the logsumexp, and the greedy continuation;
- "perplexity": transformers' perplexity of tests/data/perplexity_text.txt;
- "tokenizer" (Gemma 3): transformers' ids for texts, with and without special tokens.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch

GOLDEN_DIRECTORY = Path(__file__).parent.parent / "data" / "golden"
DECIMALS = 5
TOP_K = 8


@functools.lru_cache(maxsize=None)
def model_file_key(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 22), b""):
            digest.update(chunk)
    return {"name": path.name, "size": path.stat().st_size, "sha256": digest.hexdigest()}


def golden_path(name: str) -> Path:
    return GOLDEN_DIRECTORY / f"{name}.json"


@functools.lru_cache(maxsize=None)
def load_golden(name: str, model_path: Path) -> dict:
    """The golden file `name`, after checking that it was made from `model_path`."""
    path = golden_path(name)
    golden = json.loads(path.read_text(encoding="utf-8"))
    expected = model_file_key(Path(model_path))
    if golden["model_file"] != expected:
        raise AssertionError(f"{path} was made from {golden['model_file']}, not from {expected}: regenerate it "
                             f"with `python tests/model/make_golden.py {name}`")
    return golden


def rounded(values) -> list:
    return [round(float(value), DECIMALS) for value in values]


def logits_summary(logits: torch.Tensor, top_k: int = TOP_K) -> dict:
    """[positions, vocab] logits -> what a golden sequence keeps of them."""
    logits = logits.double()
    top_values, top_ids = logits.topk(top_k, dim=-1)
    return {"top_ids": top_ids.tolist(), "top_logits": [rounded(row) for row in top_values.tolist()],
            "logsumexp": rounded(torch.logsumexp(logits, dim=-1).tolist())}


def largest_summary_difference(logits: torch.Tensor, summary: dict, same_argmax: bool = True) -> float:
    """The largest difference between `logits` ([positions, vocab]) and a golden summary: at the
    golden top-k ids and in the logsumexp. same_argmax: also assert that every position's largest
    logit is the golden one."""
    # Reduced in float32 (float64 over a [1,400, 262,144] Gemma tensor takes seconds; float32's own
    # error, about 1e-6 of the logsumexp, is far below the tolerances), compared in float64.
    logits = logits.float()
    top_ids = torch.tensor(summary["top_ids"])
    assert logits.shape[0] == top_ids.shape[0]
    if same_argmax:
        assert torch.equal(logits.argmax(-1), top_ids[:, 0]), "a position's largest logit is not the golden one"
    at_top = (logits.gather(1, top_ids).double() - torch.tensor(summary["top_logits"], dtype=torch.float64)).abs().max()
    lse = (torch.logsumexp(logits, dim=-1).double() - torch.tensor(summary["logsumexp"], dtype=torch.float64)).abs().max()
    return max(at_top.item(), lse.item())


def greedy_continuations(llm, prompts: dict, num_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """Every prompt (name -> text or conversation) in one batch, EOS ignored: name -> (prompt ids,
    the engine's greedy continuation). One-by-one equality is test_engine_invariance's job."""
    from reference import prompt_token_ids
    from tokios.sampling_params import SamplingParams

    names = sorted(prompts)
    token_ids = [prompt_token_ids(llm.tokenizer, prompts[name]) for name in names]
    outputs = llm.generate(token_ids, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    llm.check_invariants()
    return {name: (ids, list(output.outputs[0].token_ids)) for name, ids, output in zip(names, token_ids, outputs)}


def golden_sequences(name: str, model_path: Path, continuations: dict) -> dict[str, dict]:
    """The golden file's sequences, checked to be of the same prompts as `continuations` (from
    greedy_continuations), with the same prompt ids."""
    sequences = load_golden(name, model_path)["sequences"]
    assert sorted(sequences) == sorted(continuations), f"the prompts changed: regenerate {name}.json"
    for prompt_name, (prompt_ids, _) in continuations.items():
        assert prompt_ids == sequences[prompt_name]["prompt_ids"], f"{prompt_name} changed: regenerate {name}.json"
    return sequences
