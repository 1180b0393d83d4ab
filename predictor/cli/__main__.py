"""`python -m predictor.cli ...` (guarded: importing every module, as the role install test does, runs nothing)."""
import sys

from predictor.cli import main

if __name__ == "__main__":
    sys.exit(main())
