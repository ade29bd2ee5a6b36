"""Benchmarks and experiments: each module runs as a script (`python experiments/x.py`) and
imports as `experiments.x` (tests, other experiments), with the checkout's root on `sys.path`."""
