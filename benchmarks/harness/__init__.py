"""What every benchmark repeats, once: timing and paired blocks (timing), the JSON ``meta``
block and results file (meta), the physical floors (floors), the command line (cli), the
engines' interpreter (engines) and the worker processes a driver starts (procs).
Only the standard library at import time: drivers run in the engines' venv too."""
