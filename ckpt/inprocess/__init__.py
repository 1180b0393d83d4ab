"""In-process recovery: survivors keep their processes when a rank is lost (docs/inprocess.md).

``run(build, step, ...)`` trains under ``python -m ckpt.inprocess.launch``; ``group`` leaves a
broken process group without waiting on it; ``membership`` is the launcher's round-by-round
decision of who is in the job.
"""
from .runner import EXIT_FALLBACK, EXIT_LEAVE, Context, FallBack, Recovery, Result, run

__all__ = ["EXIT_FALLBACK", "EXIT_LEAVE", "Context", "FallBack", "Recovery", "Result", "run"]
