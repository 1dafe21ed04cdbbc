"""The fused step's kernel benchmarks: kernel rows, launch sweeps, instruction counts,
host time, launch options and trees side by side (``python -m experiments.kernel_bench``)."""
