"""``ckpt.distributed``: what a torchrun training script uses directly (the documented path).

``init_process_group`` gives each torchrun round a process group of its own (a plain one
can hang inside torch across restarts), ``exit_rank`` leaves without gloo's teardown;
``Coordinator`` and ``store_connector`` (``ckpt.coordination``) are how the engine's ranks agree.
"""
from __future__ import annotations

from .coordination import Coordinator, store_connector
from .recovery.leaving import exit_rank
from .recovery.process_group import init_process_group

__all__ = ["Coordinator", "exit_rank", "init_process_group", "store_connector"]
