"""The `predictor` commands, thin: `predictor = "predictor.cli:main"` and `python -m predictor.cli`."""
from predictor.cli.commands import main

__all__ = ["main"]
