"""In-process recovery: survivors keep their processes when a rank is lost (docs/inprocess.md).

``run(build, step, ...)`` (``entry``) trains in process under ``python -m ckpt.inprocess.launch``
(``runner``), by relaunch under plain torchrun (``launch``: the job
launcher, its store and membership decisions; ``node``: a node's launcher, which starts, watches
and reports that node's workers); ``group`` leaves a broken process group without waiting on it
and closes its connections; ``membership`` is the round-by-round decision of who is in the job;
``evictions`` maps the predictor's events to the workers to evict; ``control`` signs every store
value they act on under the job's secret, and ``lifeline`` holds each node launcher's connection.
"""
from typing import Any

from .protocol import EXIT_FALLBACK, EXIT_LEAVE

__all__ = ["EXIT_FALLBACK", "EXIT_LEAVE", "Context", "FallBack", "Recovery", "Result", "run"]


def __getattr__(name: str) -> Any:
    """``run`` and the runner's types, imported when first used: the launchers
    (``python -m ckpt.inprocess.launch``) import this package, and need no checkpoint engine."""
    if name == "run":
        from .entry import run
        return run
    if name in __all__:
        from . import runner
        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
