"""Quick single-stream greedy speed with and without n-gram speculation (int4), one process."""
import time
from tokios.engine import LLM
from tokios.sampling_params import SamplingParams
from tokios.speculative.config import SpeculativeConfig

CODE = "\n".join(f"def step_{i}(total, value):\n    total = total + value * {i}\n    return total\n" for i in range(6))
TASKS = {"input-grounded": [{"role": "user", "content": "Repeat this code with the variable total renamed to running_sum:\n" + CODE}],
         "open chat": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]}
llm = LLM(enable_prefix_caching=False, speculative_config=SpeculativeConfig(num_speculative_tokens=4, enable_adaptive=False))
for task, messages in TASKS.items():
    results = {}
    for method in ["none", "ngram", "none", "ngram"]:
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, speculative={"method": method})
        before = llm.stats()
        t = time.perf_counter(); out = llm.chat(messages, params)[0].outputs[0]; dt = time.perf_counter() - t
        after = llm.stats()
        drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
        accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
        drafts = after.spec_num_drafts - before.spec_num_drafts
        results.setdefault(method, []).append((len(out.token_ids) / dt, out.token_ids, drafted, accepted, drafts))
    base = max(r[0] for r in results["none"]); spec = max(r[0] for r in results["ngram"])
    same = results["none"][0][1] == results["ngram"][0][1]
    _, _, drafted, accepted, drafts = results["ngram"][-1]
    a = accepted / drafted if drafted else 0
    print(f"{task}: none {base:.1f} tok/s, ngram {spec:.1f} tok/s, speedup {spec/base:.2f}x, identical={same}, "
          f"acceptance {a:.2f}, mean accepted per draft {accepted/max(drafts,1):.2f}")
