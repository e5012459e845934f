"""Tensor and pipeline parallel on torch.distributed (docs/scale-out.md).

The front process keeps the scheduler, the KV manager, the sampler and the output head; the
model's layers run in worker processes, one per rank, that it starts (or that `tokios worker`
starts on another machine). plan.py decides who holds what and shards the weights, messages.py
is what travels each step, worker.py is a rank's loop, executor.py the front's side.
"""
