"""Per-step sampler overhead: `python -m tokios.sampler.bench [--batch 16 --vocab 49152 --device cpu]`.

Measures, for one batch shape, the host+device time of building SamplingMetadata from runner state
(SamplingMetadata.from_states) and of the Sampler call, per scenario, as medians over many steps.
Logits come in two shapes: "peaked" (Zipf-like, as a language model's next-token distribution
usually is) and "flat" (random normal, the worst case for top-p). Results go to docs/sampling.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokios.sampler.metadata import SamplingMetadata
from tokios.sampler.sampler import Sampler
from tokios.sampler.state import SamplingStateStore
from tokios.sampling_params import SamplingParams

SCENARIOS: dict[str, SamplingParams] = {
    "greedy (fast path)": SamplingParams(temperature=0),
    "greedy + logprobs=5": SamplingParams(temperature=0, logprobs=5),
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temp, top_k 50, top_p 0.9, min_p 0.05, seeded": SamplingParams(
        temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, seed=1
    ),
    "full: all of the above + penalties, bias, logprobs=5": SamplingParams(
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        seed=1,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={5: 2.0, 9: -3.0},
        logprobs=5,
    ),
}


def make_logits(kind: str, num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    if kind == "flat":
        return torch.randn(num_rows, vocab_size, device=device) * 2
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float32, device=device)
    zipf = -1.1 * ranks.log() * 3  # logits whose softmax falls off like rank^-3.3
    return torch.stack([zipf[torch.randperm(vocab_size, device=device)] for _ in range(num_rows)])


def measure(params: SamplingParams, logits: torch.Tensor, num_steps: int) -> tuple[float, float]:
    """Median milliseconds per step of (metadata build, sampler call)."""
    num_rows, vocab_size = logits.shape
    store = SamplingStateStore(vocab_size, logits.device)
    states = [store.add(params.clone(), list(range(100, 400))) for _ in range(num_rows)]
    outputs: list[list[int]] = [[] for _ in range(num_rows)]
    sampler = Sampler()
    build_ms, sample_ms = [], []
    for step in range(num_steps):
        start = time.perf_counter()
        metadata = SamplingMetadata.from_states(store, states, outputs)
        built = time.perf_counter()
        token_ids = sampler(logits, metadata).sampled_token_ids.tolist()  # the one host sync
        done = time.perf_counter()
        for output, token_id in zip(outputs, token_ids):
            output.append(token_id)
        if step >= 3:  # warm-up
            build_ms.append((built - start) * 1e3)
            sample_ms.append((done - built) * 1e3)
    return statistics.median(build_ms), statistics.median(sample_ms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"batch {args.batch}, vocab {args.vocab}, device {device}, threads {torch.get_num_threads()}")
    print(f"{'scenario':55s} {'logits':7s} {'build ms':>9s} {'sample ms':>10s}")
    for kind in ("peaked", "flat"):
        logits = make_logits(kind, args.batch, args.vocab, device)
        for name, params in SCENARIOS.items():
            build_ms, sample_ms = measure(params, logits, args.steps)
            print(f"{name:55s} {kind:7s} {build_ms:9.3f} {sample_ms:10.3f}")


if __name__ == "__main__":
    main()
