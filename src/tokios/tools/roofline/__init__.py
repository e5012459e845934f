"""`tokios roofline`: the machine's measured roofs, and the engine's prefill and decode against them.

microbench.py measures the roofs, measure.py times a live engine's steps, roofs.py classifies the
points and gives the verdict (over plan/formulas.py), chart.py draws them and cli.py prints them.
"""
