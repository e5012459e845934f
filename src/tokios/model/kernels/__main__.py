"""`python -m tokios.model.kernels`: build the CPU kernel now and say which path runs (scripts/setup)."""

from tokios.model.kernels import kernel_status

print(f"tokios quantized linear: {kernel_status()}")
