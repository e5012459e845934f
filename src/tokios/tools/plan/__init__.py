"""`tokios plan`: capacity planning by formula, without torch.

formulas.py holds the arithmetic of serving a transformer (also used by roofline/),
model_presets.py the presets and the --model lookup (a file's shape is model/shape.py's),
hardware.py the devices, capacity.py the plan made from them, and cli.py the command line and
table.
"""
