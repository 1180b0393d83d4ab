"""How a rank leaves without the interpreter's teardown.

``os._exit`` skips every flush, so what was logged is flushed first (``flush_logs``). A rank
whose training is over leaves through ``exit_rank``: with gloo, a worker thread still joinable
when the interpreter finalizes aborts the process ("terminate called without an active
exception", SIGABRT) after its work is done, and torchrun then reports the job failed. Seen in
our CI with torch 2.13; pytorch/pytorch#179291 (destroy the groups at exit) was abandoned.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def flush_logs() -> None:
    """What was logged reaches its files before ``os._exit``."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank whose training is over: wait for every rank (no rank tears gloo down while a
    peer is still in a collective), destroy the process group and exit with ``code``. Close
    checkpoint managers first: atexit handlers do not run."""
    import torch.distributed as dist  # here: the quarantine CLI, which flushes, stays free of torch

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    flush_logs()
    os._exit(code)
