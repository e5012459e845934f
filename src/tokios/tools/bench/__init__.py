"""`tokios bench`: benchmarks that run tokios and its peers (llama.cpp, transformers) side by side.

cli.py wires the sub-commands to their modules (offline, prefix, restart, serve, compare,
capacity, fairness); prompts.py makes the prompts, engines.py wraps the in-process systems,
peers.py finds the model file and runs llama-server, stats.py computes the figures and report.py
prints and saves them.
"""
