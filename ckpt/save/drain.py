"""The background path between tiers: a priority queue of drain jobs served by one
thread, urgent jobs first, with errors kept for the next ``save()``/``wait()``.

The drain knows nothing of tiers: the manager hands it a callable per job. What it
owns is ordering, completion tracking (``SaveHandle``) and error surfacing, so that a
failure in the background never kills training silently.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

from ..errors import Abandoned, BackgroundError

log = logging.getLogger(__name__)


class SaveObserver(Protocol):
    """Told about every save's progress (the metrics exporter is one)."""

    def durable(self, handle: "SaveHandle", tier: str) -> None: ...

    def failed(self, handle: "SaveHandle") -> None: ...


class SaveHandle:
    """What ``save()`` returns: the step, and when it became durable in each tier."""

    def __init__(self, step: int, tiers: Iterable[str], *, nbytes: int = 0,
                 observer: SaveObserver | None = None) -> None:
        self.step, self.nbytes = step, nbytes
        self.started = time.monotonic()
        self.blocking_s = 0.0
        self.durable_s: dict[str, float] = {}  # tier -> seconds from save() to durable there
        self._pending = {t: threading.Event() for t in tiers}
        self.error: BaseException | None = None
        self.superseded_by: int | None = None  # the newer step drained instead of this one (overlap=True)
        self._followers: list[SaveHandle] = []  # superseded handles, resolved with this one
        self._observer = observer

    def mark(self, tier: str) -> None:
        """Durable in ``tier`` now (a tier the handle does not wait for, e.g. a periodic
        save's peer replica, is recorded all the same)."""
        self.durable_s[tier] = time.monotonic() - self.started
        self.give_up(tier)
        if self._observer is not None:
            self._observer.durable(self, tier)

    def give_up(self, tier: str) -> None:
        """``tier`` will not get this step (a best-effort tier such as a peer replica that
        failed): waiting for it ends, and ``durable_s`` has no entry for it."""
        if tier in self._pending:
            self._pending[tier].set()
        for f in self._followers:
            f.give_up(tier)

    def fail(self, error: BaseException) -> None:
        self.error = error
        for ev in self._pending.values():
            ev.set()
        for f in self._followers:
            f.fail(error)
        if self._observer is not None:
            self._observer.failed(self)

    def supersede(self, newer: "SaveHandle") -> None:
        """This step's drain was skipped for ``newer``'s (saving every step, the lower tiers
        take the newest snapshot): waiting for this step ends when ``newer`` is durable
        (or failed) in the same tiers; ``durable_s`` stays empty, ``superseded_by`` says why."""
        self.superseded_by = newer.step
        newer._followers.append(self)
        for tier in self.tiers:
            if tier not in newer._pending or newer._pending[tier].is_set():
                self.give_up(tier)
        if newer.error is not None:
            self.fail(newer.error)

    @property
    def done(self) -> bool:
        return all(ev.is_set() for ev in self._pending.values())

    @property
    def tiers(self) -> list[str]:
        """The tiers this handle waits for."""
        return list(self._pending)

    def wait(self, tier: str | None = None, timeout: float | None = None) -> "SaveHandle":
        """Block until durable in ``tier`` (default: every tier); raise if the drain failed."""
        events = [self._pending[tier]] if tier else list(self._pending.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for ev in events:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not ev.wait(left):
                raise TimeoutError(f"step {self.step} not durable in {tier or 'every tier'} after {timeout} s")
        if self.error is not None:
            raise BackgroundError(f"step {self.step}: {self.error}") from self.error
        return self


class Lease:
    """Calls ``release`` once every holder has let go: a memory slot that two drains
    (disk, and an urgent upload) read at the same time is reused only after both."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._holders, self._release, self._lock = 1, release, threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._release()


class Claim:
    """A queued drain that a newer snapshot may make moot. Whoever moves it first decides:
    the drain thread starting it, or the trainer holding it (then skipping or releasing it,
    as every rank agreed)."""

    def __init__(self) -> None:
        self._state, self._cond = "queued", threading.Condition()

    def start(self) -> bool:
        """The drain thread: False when the job was skipped (waits while it is held)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state != "held")
            if self._state == "skipped":
                return False
            self._state = "running"
            return True

    def hold(self) -> bool:
        with self._cond:
            if self._state == "queued":
                self._state = "held"
            return self._state == "held"

    def decide(self, skip: bool) -> None:
        with self._cond:
            self._state = "skipped" if skip else "queued"
            self._cond.notify_all()

    @property
    def skipped(self) -> bool:
        return self._state == "skipped"

    @property
    def open(self) -> bool:
        """Not started, not skipped: it may still be skipped."""
        return self._state == "queued"


class Pace:
    """Skippable drains (saving every step with ``overlap``) start at most once per
    ``interval_s``: the lower tiers (checksums, peers, disk) take the newest snapshot that
    often and the ones queued meanwhile are superseded, so their CPU stays off the training's
    cores; the memory tier keeps every step. A wait for durability (``hurry``) ends the
    pause until the next save."""

    def __init__(self, interval_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self._last_start = float("-inf")
        self._hurry = threading.Event()

    def wait_turn(self) -> None:
        """The drain thread, before a skippable drain: sleep out the rest of the interval."""
        delay = self._last_start + self.interval_s - time.monotonic()
        if delay > 0:
            self._hurry.wait(delay)

    def started(self) -> None:
        self._last_start = time.monotonic()

    def hurry(self) -> None:
        self._hurry.set()

    def resume(self) -> None:
        self._hurry.clear()


@dataclass(order=True)
class _Job:
    priority: int
    seq: int
    run: Callable[[], None] = field(compare=False)
    handle: SaveHandle = field(compare=False)
    on_exit: Callable[[], None] = field(compare=False)


class Drainer:
    def __init__(self, name: str = "ckpt-drain") -> None:
        self._queue: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._errors: list[tuple[int, BaseException]] = []  # (step, error), not yet raised
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], None], handle: SaveHandle, *, urgent: bool = False,
               on_exit: Callable[[], None] = lambda: None) -> None:
        """Queue ``run``; ``on_exit`` runs after it whatever happens (releases the slot)."""
        self._queue.put(_Job(0 if urgent else 1, next(self._seq), run, handle, on_exit))

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job.handle is None:  # close() sentinel, queued behind all real work
                return
            try:
                job.run()
            except BaseException as e:  # kept for the next save()/wait()
                # an abandoned wait (a recovery under way) is news, not a failure a user acts on
                log.log(logging.INFO if isinstance(e, Abandoned) else logging.ERROR,
                        "background save of step %d failed: %s", job.handle.step, e)
                job.handle.fail(e)
                with self._lock:
                    self._errors.append((job.handle.step, e))
            finally:
                job.on_exit()
                self._queue.task_done()

    def raise_error(self) -> None:
        """Raise (once) the first background failure since the last call."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            step, error = errors[0]
            raise BackgroundError(f"background write of step {step} failed: {error}{extra}") from error

    def join(self) -> None:
        self._queue.join()

    def close(self, discard: bool = False) -> int:
        """Stop once the queued jobs ran; ``discard``: once the running one ends, the others
        are dropped instead (their handles fail as abandoned, their slots are released): an
        in-process recovery waits for no checksum or disk write of a snapshot it keeps in
        memory anyway. Returns how many were dropped."""
        dropped = 0
        while discard:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job.handle is not None:
                job.handle.fail(Abandoned(f"step {job.handle.step} was not drained: the job let go of it"))
                job.on_exit()
                dropped += 1
            self._queue.task_done()
        self._queue.put(_Job(2, next(self._seq), None, None, None))  # type: ignore[arg-type]
        self._thread.join()
        return dropped
