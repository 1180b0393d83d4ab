"""Which restart round a torchrun worker belongs to, agreed through the agent's store.

torchrun keeps one store across rounds (TCP store sharing), so each round's process
group needs a namespace of its own: gloo would otherwise find the previous round's
dead peer addresses there. The local restart count cannot name the round: an agent
whose workers were restarted for a membership change (another node's worker died
first, or a replacement node joined) does not count it, and a replacement node's
agent starts at 0, so ranks of one round disagree and wait for each other forever.

Instead rank 0 draws a token for the round and hands it to every worker that asks:
a worker registers a fresh nonce under the next slot of a join log and waits for the
answer keyed by that nonce, which only the current rank 0 can give (workers of a new
round start only after every agent stopped the old one's). Answers to stale entries
of earlier rounds go to nobody and cost a key each.
"""
from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

_LOG = "ckpt-guard/round/joined"


def agree_round(connect: Callable[[], "dist.Store"], store: "dist.Store", rank: int) -> tuple[str, Callable[[], None]]:
    """This round's token, and a function to call once the process group is up (rank 0
    answers joiners until then, on a store connection of its own from ``connect``)."""
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_LOG}/{store.add(_LOG, 1)}", nonce)
        return store.get(f"ckpt-guard/round/welcome/{nonce}").decode(), lambda: None
    token, stop = uuid.uuid4().hex, threading.Event()

    def welcome() -> None:
        own, cursor = connect(), 1
        while not stop.is_set():
            key = f"{_LOG}/{cursor}"
            try:
                own.wait([key], timedelta(milliseconds=200))
            except Exception:  # torch raises DistStoreError on a timeout: look at ``stop`` again
                continue
            own.set(f"ckpt-guard/round/welcome/{own.get(key).decode()}", token)
            cursor += 1

    thread = threading.Thread(target=welcome, name="ckpt-round-welcome", daemon=True)
    thread.start()

    def done() -> None:
        stop.set()
        thread.join()

    return token, done
