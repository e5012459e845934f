"""What tensor and pipeline parallel cost per model step on this machine (docs/scale-out.md).

Every configuration is an LLM on one model (default: the default model), all alive at once and run in turn, `--runs`
times each: B prompts of about 30 tokens decoding 64 tokens each (`ignore_eos`), so nearly every
step is a decode step of B rows. For each, the median over runs of the forward's wall time per
step (timed around the runner's model.forward) and its ratio to one process with the same
total threads. For the parallel ones, where that time went, per step: the front encoding and
sending the Step message, each rank's own step time, the all-reduces inside it (tensor
parallel: two per layer; through shared memory, and again through Gloo for comparison), the wait for the previous stage and the send to the next (pipeline).
What the ranks do not account for is transit: pickling, the socket, waking the process.

    python benchmarks/parallel_overhead.py --runs 5 --batch 1 8 --parallel 1,2 3,1
    python benchmarks/parallel_overhead.py --runs 5 --batch 1 8 --model GEMMA_3_FILE --parallel 1,2 2,1
    python benchmarks/parallel_overhead.py --all-reduce --runs 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from tokios.distributed.worker import GLOO_ONLY_ENVIRONMENT_VARIABLE

BASELINES = {  # name -> (tensor parallel, pipeline parallel, threads per process)
    "1 process, 2 threads": (1, 1, 2),
    "1 process, 1 thread": (1, 1, 1),
}


def parse_group(text: str) -> tuple[int, int]:
    tp, pp = (int(part) for part in text.split(","))
    return tp, pp


class ForwardTimer:
    def __init__(self, model):
        self.model = model
        self.forward = model.forward
        self.seconds = 0.0
        self.count = 0
        model.forward = self

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.count += 1


def _all_reduce_rank(rank: int, port: int, sizes: list[int], repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    for size in sizes:
        values = torch.randn(size)
        for _ in range(repeats // 10):
            dist.all_reduce(values)
        started = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(values)
        if rank == 0:
            print(f"| {size:,} float32 | {(time.perf_counter() - started) / repeats * 1e6:.0f} |", flush=True)
    dist.destroy_process_group()


def all_reduce_latency(runs: int) -> None:
    """Gloo all-reduce between two processes alone on this machine, 1 thread each."""
    import torch.multiprocessing as mp

    from tokios.distributed.executor import free_port_pair

    print("| tensor | microseconds per all-reduce (2 processes, Gloo) |\n|---|---|")
    for _ in range(runs):
        mp.spawn(_all_reduce_rank, args=(free_port_pair("127.0.0.1"), [640, 8 * 640, 64 * 640], 500), nprocs=2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="model file (default: the default model)")
    parser.add_argument("--parallel", type=parse_group, nargs="+", default=[(1, 2), (3, 1)], metavar="TP,PP",
                        help="parallel groups to measure, 1 thread per rank (default: 1,2 3,1)")
    parser.add_argument("--all-reduce", action="store_true",
                        help="only time Gloo all-reduces between two processes (--runs times)")
    args = parser.parse_args()
    if args.all_reduce:
        all_reduce_latency(args.runs)
        return 0
    from tokios import LLM, SamplingParams

    CONFIGS = dict(BASELINES)
    gloo_only = set()
    for tp, pp in args.parallel:
        name = " x ".join(part for part, size in ((f"TP {tp}", tp), (f"PP {pp}", pp)) if size > 1)
        CONFIGS[name + " (1 thread each)"] = (tp, pp, 1)
        if tp > 1:  # the same group with its all-reduces through Gloo instead of shared memory
            CONFIGS[name + ", Gloo all-reduce"] = (tp, pp, 1)
            gloo_only.add(name + ", Gloo all-reduce")

    engines = {}
    for name, (tp, pp, threads) in CONFIGS.items():
        os.environ[GLOO_ONLY_ENVIRONMENT_VARIABLE] = "1" if name in gloo_only else "0"  # read by the ranks
        llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory="64MiB", num_threads=threads, tensor_parallel_size=tp,
                  pipeline_parallel_size=pp)
        engines[name] = (llm, ForwardTimer(llm.core.runner.model))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    try:
        for batch in args.batch:
            prompts = [f"Request {i}: write a long story about a lighthouse keeper and the sea." for i in range(batch)]
            per_step: dict[str, list[float]] = {name: [] for name in CONFIGS}
            breakdown: dict[str, list[dict]] = {name: [] for name in CONFIGS}
            for name, (llm, _) in engines.items():  # warm-up: kernels, caches, first sockets
                llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))
            for _ in range(args.runs):
                for name, (llm, timer) in engines.items():
                    time.sleep(0.3)  # let the previous engine's threads go idle
                    model = llm.core.runner.model
                    distributed = hasattr(model, "rank_timings")
                    before = (timer.seconds, timer.count)
                    ranks_before = model.rank_timings() if distributed else None
                    front_before = (model.send_s,) if distributed else None
                    llm.generate(prompts, params)
                    steps = timer.count - before[1]
                    per_step[name].append((timer.seconds - before[0]) / steps)
                    if distributed:
                        ranks_after = model.rank_timings()
                        parts = {"send": (model.send_s - front_before[0]) / steps}
                        for b, a in zip(ranks_before, ranks_after):
                            parts[f"rank {a.rank} step"] = (a.step_s - b.step_s) / steps
                            parts[f"rank {a.rank} all-reduce"] = (a.all_reduce_s - b.all_reduce_s) / steps
                            parts[f"rank {a.rank} all-reduces/step"] = (a.num_all_reduces - b.num_all_reduces) / steps
                            parts[f"rank {a.rank} recv"] = (a.receive_s - b.receive_s) / steps
                            parts[f"rank {a.rank} send"] = (a.send_s - b.send_s) / steps
                        breakdown[name].append(parts)
            base = statistics.median(per_step["1 process, 2 threads"])
            print(f"\n## {args.model or 'default model'}, batch {batch}: {args.tokens} tokens each, {args.runs} runs, "
                  f"dtype {args.dtype}\n")
            print("| configuration | forward ms/step (median) | min-max | vs 1 process, 2 threads |")
            print("|---|---|---|---|")
            for name, values in per_step.items():
                median = statistics.median(values)
                print(f"| {name} | {median * 1e3:.2f} | {min(values) * 1e3:.2f}-{max(values) * 1e3:.2f} | "
                      f"{median / base:.2f}x |")
            for name, runs in breakdown.items():
                if not runs:
                    continue
                forward = statistics.median(per_step[name])
                keys = runs[0].keys()
                medians = {key: statistics.median(run[key] for run in runs) for key in keys}
                rank_steps = [value for key, value in medians.items() if key.endswith(" step")]
                pp = CONFIGS[name][1]
                accounted = sum(rank_steps) if pp > 1 else max(rank_steps)
                print(f"\n{name}, per step (medians, ms): forward {forward * 1e3:.2f}; front encode+send "
                      f"{medians['send'] * 1e3:.3f}; " + "; ".join(
                          f"{key} {value:.0f}" if key.endswith("/step") else f"{key} {value * 1e3:.3f}"
                          for key, value in medians.items() if key != "send" and value)
                      + f"; transit and wake-ups (forward - ranks' {'summed' if pp > 1 else 'slowest'} step time "
                        f"+ recv waits) {(forward - accounted + sum(v for k, v in medians.items() if k.endswith('recv'))) * 1e3:.2f}")
    finally:
        for llm, _ in engines.values():
            llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
