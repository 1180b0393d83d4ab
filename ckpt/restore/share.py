"""Replicated keys a rank could read no copy of, sent by a rank that restored them.

Under DDP every rank holds the same model and optimizer (``replicated=``), but only the first
rank of each volume stores them: a rank whose node lost that holder (a lost node, a warm spare
on another node) finds no copy in any tier it reads, while every survivor has them, restored a
moment ago. The restore's agreement (``execute.restore_agreed``) then picks a step some rank
read whole, names it the sender, and here it sends those keys from its live state: the tree
(JSON, as a manifest holds it) and each tensor over the control group, loaded in place as a
read would be. No checkpoint bytes are unpickled: the tree goes through the coordinator's
gather, between the job's own ranks."""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..format.manifest import DTYPE_NAMES, DTYPES
from ..format.state import flatten, unflatten
from .plan import RestorePlan
from .state_load import load_into

log = logging.getLogger(__name__)


def send_missing(coord: Any, state: dict, plan: RestorePlan) -> None:
    """Collective, after every rank loaded ``plan``: the ranks whose plan left keys to receive
    get them from ``plan.sender`` (every rank calls it; nothing happens when nobody receives)."""
    if plan.sender is None:
        return
    wanted = coord.gather(sorted(plan.receive))
    keys = sorted(set().union(*map(set, wanted)))
    sending = coord.rank == plan.sender
    flat = flatten({k: state[k] for k in keys if k in state}) if sending else None
    tree, specs = coord.gather((flat.tree, [(DTYPE_NAMES[t.dtype], list(t.shape)) for _, t in flat.tensors])
                               if flat is not None else None)[plan.sender]
    tensors = []
    for i, (dtype, shape) in enumerate(specs):
        t = flat.tensors[i][1].detach().cpu().contiguous() if flat is not None else \
            torch.empty(shape, dtype=DTYPES[dtype])
        coord.broadcast(t, plan.sender)
        tensors.append(t)
    if plan.receive:
        load_into(state, {k: v for k, v in unflatten(tree, lambda i: tensors[i]).items() if k in plan.receive})
        log.info("rank %d: step %d's %s sent by rank %d (no copy in a tier it reads)", coord.rank,
                 plan.ckpt_id.step, ", ".join(sorted(plan.receive)), plan.sender)
