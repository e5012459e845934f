"""`tokios simulate`: a discrete-event simulation of a serving fleet under a workload.

The package owns the simulator, split by concern:

- workload.py: arrivals (Poisson or bursty), prompt/output length distributions, shared system
  prompts; makes the list of `SimRequest`s every policy is run on.
- cost_model.py: what one backend's step costs, from tools/plan/capacity.py and tools/plan/formulas.py (a step
  takes max(compute time, memory time) of the batch it runs), and a run of decode steps in closed form.
- calibration.py: efficiencies fitted to the measured points of `tokios roofline --json`.
- prefix_cache.py, backend.py: one backend, a continuous-batching scheduler (token budget,
  chunked prefill, KV capacity, a prefix cache), and the exponential single server the queueing
  tests use.
- routing.py: round robin, least-busy, prefix-aware (SGLang's cache-aware rule).
- engine.py: the event loop (a heap of step-end events beside the sorted arrivals).
- report.py: percentiles, throughput and cache hit rate per policy, as a table or JSON.
- fleet_search.py: the fewest backends that meet a latency SLO, and its curve over request rates.
- replay.py: `tokios bench serve` runs replayed on one simulated backend (validation).
- chart.py: the PNG charts; cli.py: the command line.

No torch anywhere: a simulation of 10,000 backends runs in plain Python.
"""
