"""The benchmarks: each script is a thin command on the shared harness (benchmarks/harness/),
runnable as ``python benchmarks/NAME.py`` or ``python -m benchmarks.NAME``. See benchmarks/README.md."""
