"""Speed and memory benchmarks of the library, run from a checkout: ``python -m benchmarks.<name> --help``.

Every benchmark times its settings side by side in one process and prints ratios (machines are noisy); results
of earlier runs are in ``benchmarks/results/``.
"""
