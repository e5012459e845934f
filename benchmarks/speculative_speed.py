"""Single-stream greedy decode speed with and without n-gram speculation (int4), one process.

Decode tok/s counts the tokens after the first over the time after the first (prefill excluded,
so a long prompt does not dilute the speedup); end-to-end tok/s includes the prefill. Runs
alternate between plain and speculative decoding, and the median of --reps runs is reported.
The speedup is checked against the formula (1 - a^(k+1)) / (1 - a) / (1 + k c), where the
verify cost per proposed token, c, is measured here: a verify step of k + 1 rows against a
plain one-row step.

    python benchmarks/speculative_speed.py [--reps 3] [--num-speculative-tokens 4] [--methods ngram,self_draft]
"""
import argparse
import statistics
import time

import torch

from tokios.config import SpeculativeConfig
from tokios.engine import LLM
from tokios.model.attention import AttentionMetadata
from tokios.model_files import default_model_path
from tokios.sampling_params import SamplingParams

CODE = "\n".join(f"def step_{i}(total, value):\n    total = total + value * {i}\n    return total\n" for i in range(6))
TASKS = {"input-grounded": [{"role": "user", "content": "Repeat this code with the variable total renamed to running_sum:\n" + CODE}],
         "open chat": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]}


def decode_rows_cost(llm: LLM, num_rows: int, context_len: int = 300, reps: int = 30) -> float:
    """Seconds of one fused decode step over num_rows rows of one request's context (what a
    verify of num_rows - 1 proposals runs), best of reps."""
    model, kv_caches = llm.core.model, llm.core.runner.kv_caches
    slots = torch.arange(context_len + num_rows)
    tables = slots.repeat(num_rows, 1)  # row r attends to the first context_len + 1 + r slots
    lens = torch.tensor([context_len + 1 + r for r in range(num_rows)])
    metadata = AttentionMetadata(slot_mapping=slots[context_len:context_len + num_rows], num_decode_tokens=num_rows,
                                 decode_slot_indices=tables, decode_context_lens=lens)
    ids, positions = torch.zeros(num_rows, dtype=torch.long), lens - 1
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        model.compute_logits(model.forward(ids, positions, metadata, kv_caches))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default="ngram",
                        help="comma-separated: ngram, self_draft, draft_model (the default model drafting for itself)")
    parser.add_argument("--self-draft-layers", type=int, default=6)
    args = parser.parse_args()
    k = args.num_speculative_tokens
    methods = args.methods.split(",")
    draft = str(default_model_path()) if "draft_model" in methods else None
    llm = LLM(enable_prefix_caching=False,
              speculative_config=SpeculativeConfig(num_speculative_tokens=k, enable_adaptive=False, draft_model=draft,
                                                   self_draft_num_layers=args.self_draft_layers))
    one_row, verify = decode_rows_cost(llm, 1), decode_rows_cost(llm, k + 1)
    c = (verify / one_row - 1) / k
    print(f"verify step of {k + 1} rows: {verify * 1e3:.2f} ms vs one row {one_row * 1e3:.2f} ms "
          f"-> c = {c:.3f} per proposed token")
    for task, messages in TASKS.items():
        runs: dict[str, list] = {"none": [], **{method: [] for method in methods}}
        for _ in range(args.reps):
            for method in runs:
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                        speculative={"method": method})
                before = llm.stats()
                start = time.perf_counter()
                output = llm.chat(messages, params)[0]
                elapsed = time.perf_counter() - start
                after = llm.stats()
                metrics, tokens = output.metrics, output.outputs[0].token_ids
                decode_rate = (len(tokens) - 1) / (metrics.last_token_time - metrics.first_token_time)
                runs[method].append({
                    "decode": decode_rate, "e2e": len(tokens) / elapsed, "tokens": tokens,
                    "drafted": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                    "accepted": after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                    "drafts": after.spec_num_drafts - before.spec_num_drafts})
        base = statistics.median(r["decode"] for r in runs["none"])
        base_e2e = statistics.median(r["e2e"] for r in runs["none"])
        print(f"{task}: plain decode {base:.1f} tok/s, end-to-end {base_e2e:.1f} tok/s")
        for method in methods:
            spec = statistics.median(r["decode"] for r in runs[method])
            spec_e2e = statistics.median(r["e2e"] for r in runs[method])
            identical = all(r["tokens"] == runs["none"][0]["tokens"] for r in runs["none"] + runs[method])
            drafted = sum(r["drafted"] for r in runs[method])
            accepted = sum(r["accepted"] for r in runs[method])
            drafts = sum(r["drafts"] for r in runs[method])
            a = accepted / drafted if drafted else 0.0
            per_verify = 1 + accepted / max(drafts, 1)  # tokens a verify step yields, measured
            geometric = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1  # tokens per verify if i.i.d.
            print(f"  {method}: decode {spec:.1f} tok/s, speedup {spec / base:.2f}x; end-to-end {spec_e2e:.1f} tok/s "
                  f"({spec_e2e / base_e2e:.2f}x); identical={identical}; acceptance {a:.2f}, tokens per verify "
                  f"{per_verify:.2f} (geometric in a: {geometric:.2f})")
            print(f"    formula (1 - a^(k+1)) / (1 - a) / (1 + k c) = {geometric / (1 + k * c):.2f}x; with the "
                  f"measured tokens per verify in place of the geometric sum: {per_verify / (1 + k * c):.2f}x "
                  f"(c = the verify rows only; a draft model's own steps come on top)")


if __name__ == "__main__":
    main()
