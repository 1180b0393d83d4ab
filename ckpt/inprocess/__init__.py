"""In-process recovery: survivors keep their processes when a rank is lost (docs/inprocess.md).

``run(build, step, ...)`` (``entry``) trains in process under ``python -m ckpt.inprocess.launch``
(``runner``), by relaunch under plain torchrun (``launch``: the job
launcher, its store and membership decisions; ``node``: a node's launcher, which starts, watches
and reports that node's workers); ``group`` leaves a broken process group without waiting on it
and closes its connections; ``membership`` is the round-by-round decision of who is in the job;
``evictions`` maps the predictor's events to the workers to evict; ``control`` signs every store
value they act on under the job's secret, and ``lifeline`` holds each node launcher's connection.
"""
from .entry import run
from .runner import EXIT_FALLBACK, EXIT_LEAVE, Context, FallBack, Recovery, Result

__all__ = ["EXIT_FALLBACK", "EXIT_LEAVE", "Context", "FallBack", "Recovery", "Result", "run"]
