"""``python -m ckpt.inprocess.launch``: the one command that starts an in-process-recovering job.

    python -m ckpt.inprocess.launch --nproc 3 --spares 1 train.py [args]
    python -m ckpt.inprocess.launch --nodes 2 --node-rank 0 --master-addr H --master-port P --nproc 2 train.py [args]
    python -m ckpt.inprocess.launch --nodes 2 --node-rank 1 --master-addr H --master-port P --nproc 2 train.py [args]
    python -m ckpt.inprocess.launch --nnodes 2 --nproc-per-node 2 --rdzv-endpoint H:P --node-rank 1 train.py

torchrun's agent stops every local worker when one fails; this launcher keeps the healthy
ones. The job launcher (node rank 0) hosts the job's store (MASTER_ADDR/MASTER_PORT for the
workers) and decides membership (``membership.py``); every node runs a node launcher
(``node.py``; on node 0 inside the job launcher) that starts ``--nproc`` workers and
``--spares`` warm spares there (torch imported, no shard, waiting) and reports their exits.
When a member exits with an error, a spare takes its rank (one on another node first), else
the world shrinks (down to ``--min-world``). A member whose beat and CPU time stopped
(``--hang-s``: SIGSTOP, a process wedged in the kernel) or that is evicted through the store
(``membership.evict``: a predicted node failure, an XID 79) or that is left behind by the
others past the watchdog's progress deadline (``--progress-s``) is SIGKILLed first by its node
launcher. A node launcher whose lifeline closes (it died) or that is silent for ``--hang-s``
(its host vanished) is a lost node: all its members go in one round, its spares leave the
pool. A spare called in is replaced by a new one on its node, so the pool stays at
``--spares``. A member that finds the newest snapshot unsound (``membership.rewind``: a
suspect or non-finite snapshot, a failed canary) gets a round with the same members, in which
every rank restores the newest sound step in its process (at most ``MAX_REWINDS`` a launch,
then a relaunch); a worker that stops the job (``EXIT_STOP``: a canary failed again) ends it.
A worker that asks for it (``EXIT_FALLBACK``), or a job that cannot shrink further, is
relaunched whole, at most ``--relaunches`` times: every node launcher still there starts its
workers again, on keys of the new attempt in the same store (a node lost meanwhile takes no
part); every decision is logged with its reason.

The job's secret (``ckpt.secret``: ``CKPT_JOB_SECRET_FILE`` or ``CKPT_JOB_SECRET``, never argv)
signs every control value (``control.py``) and keys the lifelines and peer replicas: on one
node the launcher makes one when none is given; with ``--nodes`` > 1 every node must be given
the same one. The store listens on ``--master-addr`` only (docs/security.md).
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from .. import secret
from ..control import control_key
from . import membership, preload, progress
from .lifeline import Lifelines
from .node import POLL_S, NodeLauncher, run_node
from .preload import Starter
from .protocol import BEAT_S, EXIT_FALLBACK, EXIT_STOP

log = logging.getLogger("ckpt.inprocess.launch")
MAX_REWINDS = 3  # unsound snapshots a launch goes back from in process before it relaunches


class Job:
    """One launch of the workers on every node (a relaunch is a new Job, on keys of its own)."""

    def __init__(self, args: argparse.Namespace, attempt: int, base: "dist.TCPStore", lost: set[int],
                 start: Starter | None = None) -> None:
        self.store = membership.of_attempt(base, attempt, control_key())
        n, per_node = args.nproc, args.nproc + args.spares
        # worker ids K * (nproc + spares) + i on node K: members first, then spares; nodes lost
        # in an earlier attempt take no part
        self.hosts = {k * per_node + i: k for k in range(args.nodes) if k not in lost for i in range(per_node)}
        # the first nodes still there run the members; the last --spare-nodes only spares (a relaunch
        # after a lost node moves its members onto a spare node)
        working = set(sorted(set(self.hosts.values()))[:args.nodes - args.spare_nodes])
        self.members = [w for w in self.hosts if w % per_node < n and self.hosts[w] in working]
        self.spares = sorted(self.hosts.keys() - set(self.members))  # ids ascend as self.hosts does
        self.min_world, self.round, self.hang_s, self.nproc = args.min_world, 0, args.hang_s, n
        self.working_nodes = args.nodes - args.spare_nodes
        self.finished: set[int] = set()
        self.seen: set[int] = set()  # workers whose exit was read
        self.read_at = 0.0  # when the nodes' beats and the members' steps were last read
        self.nodes: dict[int, tuple[int, float]] = {}  # live node -> (beat count, when it last changed)
        self.steps = progress.Steps()  # every member's, for the job's lowest and highest (``progress.py``)
        self.lost = set(lost)
        self.rewinds = 0  # rounds that went back to a sound step (``_rewind``)
        self.stopped = False  # a worker stopped the job (``EXIT_STOP``): it is not relaunched
        self.lifelines = Lifelines(args.master_addr, self.store, set(self.hosts.values()) - {0})
        self.node_count = args.nodes  # every node of the attempt gets its part of each round (``membership.publish``)
        membership.publish(self.store, membership.Membership(0, tuple(self.members), tuple(self.spares),
                                                             "start", 0.0), self.hosts, self.node_count)
        log.info("attempt %d: workers %s, spares %s on %d node(s)", attempt, self.members, self.spares,
                 len(set(self.hosts.values())))
        self.local = NodeLauncher(self.store, 0, master=(args.master_addr, base.port), command=args.command,
                                  attempt=attempt, hang_s=args.hang_s, progress_s=args.progress_s, start=start)

    def watch(self) -> tuple[bool, str]:
        """Until the members have finished (True) or the job must be relaunched (False, why)."""
        while (outcome := self.tick()) is None:
            time.sleep(POLL_S)
        return outcome

    def tick(self) -> tuple[bool, str] | None:
        """One launcher tick: the local node's; once a ``BEAT_S`` (or at once when the exits flag is set)
        every node's beat, which lists the exits it reported, and every member's step; the
        outcome once the job is over (see ``watch``), else None."""
        self.local.poll()
        raw = self.store.store
        exited = raw.check([membership.EXITS_KEY])  # one round trip a tick, not one a worker
        if exited:
            raw.delete_key(membership.EXITS_KEY)  # before the beats are read: a later exit sets it again
        cut = set(self.lifelines.cut())
        now = time.monotonic()
        if not exited and not cut and now - self.read_at < BEAT_S:
            return None
        self.read_at = now
        live = sorted(set(self.hosts.values()) - self.lost)
        beats = dict(zip(live, self.store.many_signed([membership.node_key(k) for k in live])))
        reported = {w for b in beats.values() if b is not None for w in json.loads(b.payload)} - self.seen
        for w, text in zip(sorted(reported), self.store.many([membership.exit_key(w) for w in sorted(reported)])):
            if text is None or w not in self.hosts:
                continue
            self.seen.add(w)
            ended = json.loads(text)
            if w in self.spares:
                self.spares.remove(w)
                log.warning("spare %d left (%s)", w, ended["cause"])
            elif w not in self.members:
                continue
            elif ended["code"] == 0:
                self.finished.add(w)
            elif ended["code"] in (EXIT_FALLBACK, EXIT_STOP):
                said = "" if (reason := self.store.get(membership.fallback_key(w))) is None else f": {reason.decode()}"
                self.stopped = ended["code"] == EXIT_STOP
                return False, f"worker {w} {'stopped the job' if self.stopped else 'asked for a relaunch'}{said}"
            elif why := self._replace([w], f"worker {w} (rank {self.members.index(w)}) {ended['cause']}"):
                return False, why
        if self.finished and self.finished >= set(self.members):
            return True, "done"
        if why := self._lost_nodes(beats, cut, now):
            return False, why
        # a rewind is asked for with the exits flag (``membership.rewind``): looked for only then
        if exited and (unsound := self.store.get(membership.rewind_key(self.round))) is not None:
            if why := self._rewind(unsound.decode()):
                return False, why
        reached = self.steps.read(self.store, [w for w in self.members if w not in self.finished], self.round, now)
        progress.publish(self.store, self.round, reached)
        return None

    def _lost_nodes(self, beats: dict[int, object], cut: set[int], now: float) -> str | None:
        """A node launcher whose lifeline closed (``lifeline.py``: it died) or whose beat stopped
        for ``hang_s`` (its host went silent) is a lost node: its spares leave the pool and its
        members go in one round. ``beats``: each live node's last beat (``Signed``). The reason
        to relaunch instead, if any."""
        for k in sorted(beats):
            beat = beats[k]
            count = 0 if beat is None else beat.seq
            last, since = self.nodes.get(k, (-1, now))
            if k in cut:
                how = "its launcher's lifeline closed"
            elif count != last:
                self.nodes[k] = (count, now)
                continue
            elif count > 0 and now - since > self.hang_s:
                how = f"no beat for {now - since:.1f} s"
            else:
                continue
            self.lost.add(k)
            self.spares = [w for w in self.spares if self.hosts[w] != k]
            gone = [w for w in self.members if self.hosts[w] == k]
            log.warning("node %d lost: %s (members %s)", k, how, gone)
            if gone and (why := self._replace(gone, f"node {k} lost ({how})")):
                return why
        return None

    def _replace(self, lost: list[int], cause: str) -> str | None:
        """Publish the next round without the ``lost`` members (a ready spare takes each one's rank
        while there is one); the reason to relaunch instead, if any."""
        fault_time = time.time()
        members = list(self.members)
        ready = [w for w in self.spares if self.store.has(membership.ready_key(w))]
        called = []
        for worker in lost:
            if ready:
                spare = ready.pop(0)
                self.spares.remove(spare)
                members[members.index(worker)] = spare
                called.append(spare)
                new = max(self.hosts) + 1  # the pool is topped up: a new spare warms up on that node
                self.hosts[new] = self.hosts[spare]
                self.spares.append(new)
            else:
                members.remove(worker)
        what = [f"spare {s} takes rank {members.index(s)}" for s in called]
        what += [f"continuing at world size {len(members)}"] if len(members) < len(self.members) else []
        if len(members) < self.min_world:
            return f"{cause}: {len(members)} ranks left, fewer than --min-world {self.min_world}"
        self.members = members
        self._publish(f"{cause}: {', '.join(what)}", fault_time)
        return None

    def _rewind(self, unsound: str) -> str | None:
        """Publish the next round with the same members: every rank restores the newest sound
        step in its process. A job that keeps finding unsound snapshots (a device that keeps
        going wrong) is relaunched after ``MAX_REWINDS`` (the reason to, if so)."""
        self.rewinds += 1
        if self.rewinds > MAX_REWINDS:
            return f"{unsound} (unsound {self.rewinds} times in this launch)"
        self._publish(f"{unsound}: every rank goes back to the newest sound step", time.time())
        return None

    def _publish(self, reason: str, fault_time: float) -> None:
        """The next round: the members and spares as they now are, and why."""
        self.round += 1
        self.steps.new_round()
        membership.publish(self.store, membership.Membership(self.round, tuple(self.members), tuple(self.spares),
                                                             reason, fault_time), self.hosts, self.node_count)
        log.warning("round %d: %s", self.round, reason)

    def can_relaunch(self) -> bool:
        """Whether the nodes left can run the job again (``--min-world`` members)."""
        live = min(len(set(self.hosts.values()) - self.lost), self.working_nodes)
        if live * self.nproc < self.min_world:
            log.error("no relaunch: %d node(s) left, %d ranks, fewer than --min-world %d", live, live * self.nproc,
                      self.min_world)
            return False
        return True

    def stop(self, why: str, *, again: bool = False) -> None:
        """The job is over or launched ``again``: release the spares, end what is left, and give the
        other nodes' launchers (bounded by ``hang_s``) the time to end theirs before the store goes
        or the next attempt starts."""
        if again:
            self.store.put(membership.RELAUNCH_KEY, "1", round=self.round)
        self.store.put(membership.DONE_KEY, why, round=self.round)
        self.local.stop()
        others = [membership.left_key(k) for k in set(self.hosts.values()) - self.lost - {0}]
        deadline = time.monotonic() + self.hang_s
        while others and not all(self.store.has(k) for k in others) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.lifelines.close()


# torchrun's options this launcher has no counterpart for, refused by name (with why) rather than ignored
_REFUSED = {
    "--rdzv-conf": "the job launcher's store is the rendezvous", "--max-nodes": "no elastic node count",
    "--min-nodes": "no elastic node count", "--role": "one role", "--no-python": "workers run the script in python",
    "--module": "give the script's path", "--run-path": "give the script's path", "--local-addr": "no such choice",
    "--logs-specs": "workers write to the node launcher's stdout/stderr",
    "--log-dir": "workers write to the node launcher's stdout/stderr",
    "--redirects": "workers write to the node launcher's stdout/stderr",
    "--tee": "workers write to the node launcher's stdout/stderr",
}


def _nodes(text: str) -> int:
    """``--nnodes``: a fixed count; torchrun's elastic ``MIN:MAX`` is refused by name."""
    if ":" in text:
        lo, _, hi = text.partition(":")
        if lo != hi:
            raise argparse.ArgumentTypeError(f"elastic --nnodes {text} is not supported: give a fixed node count "
                                             "(the job shrinks in process down to --min-world instead)")
        text = lo
    return int(text)


def _nproc(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--nproc-per-node {text} is not supported: give a number")
    return int(text)


def _both(name: str) -> list[str]:
    """torchrun spells each option with dashes and with underscores: both are accepted."""
    return [name, "--" + name[2:].replace("-", "_")] if "-" in name[2:] else [name]


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The launcher's options, torchrun's among them for what the two share (``--nnodes``,
    ``--nproc-per-node``, ``--rdzv-endpoint``, ``--master-addr``/``--master-port``,
    ``--node-rank``, ``--max-restarts``), so a torchrun line changes by one word."""
    ap = argparse.ArgumentParser(prog="python -m ckpt.inprocess.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", *_both("--nproc-per-node"), dest="nproc", type=_nproc, required=True,
                    help="training ranks per node")
    ap.add_argument("--spares", type=int, default=0, help="warm spare processes per node, started with the job")
    ap.add_argument("--spare-nodes", type=int, default=0,
                    help="of --nodes, how many run only spares (all their --nproc + --spares processes)")
    ap.add_argument("--nodes", *_both("--nnodes"), dest="nodes", type=_nodes, default=1,
                    help="nodes in the job, each running this command")
    ap.add_argument(*_both("--node-rank"), type=int, default=0, help="this node's; 0 runs the job launcher (the store)")
    ap.add_argument(*_both("--master-addr"), default="127.0.0.1",
                    help="the job launcher's host as every node reaches it (its workers announce it to peers)")
    ap.add_argument(*_both("--master-port"), type=int, default=0,
                    help="the job's store port (any free one on one node)")
    ap.add_argument(*_both("--rdzv-endpoint"), default=None, metavar="HOST:PORT",
                    help="torchrun's spelling of --master-addr HOST --master-port PORT")
    ap.add_argument(*_both("--rdzv-backend"), choices=("c10d", "static"), default=None,
                    help="accepted: the job launcher's store is the rendezvous (a TCP store, as c10d's)")
    ap.add_argument(*_both("--rdzv-id"), default=None, help="accepted and unused (the store names the job)")
    ap.add_argument("--standalone", action="store_true", help="accepted: one node, a free port (the default)")
    ap.add_argument(*_both("--monitor-interval"), type=float, default=None, help="accepted and unused")
    ap.add_argument("--min-world", type=int, default=1, help="relaunch rather than shrink below this")
    ap.add_argument("--hang-s", type=float, default=10.0,
                    help="kill a member whose beat (every 0.2 s) and CPU time stopped this long (a frozen "
                         "process); a node launcher silent this long is a lost node")
    ap.add_argument("--progress-s", type=float, default=None,
                    help="evict a member left behind by the others (alive, not stepping) after this long "
                         "(default: the watchdog's policy, 5 x the median step, at least 10 s)")
    ap.add_argument("--relaunches", *_both("--max-restarts"), dest="relaunches", type=int, default=1,
                    help="whole-job relaunches, on every node still there, when in-process recovery fails")
    for name in _REFUSED:
        ap.add_argument(*_both(name), dest=f"refused_{name[2:]}", nargs="?", const=True, default=None,
                        help=argparse.SUPPRESS)
    preload.add_options(ap)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the training script and its arguments")
    args = ap.parse_args(argv)
    for name, why in _REFUSED.items():
        if getattr(args, f"refused_{name[2:]}") is not None:
            ap.error(f"torchrun's {name} is not supported by the in-process launcher: {why}")
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            ap.error(f"--rdzv-endpoint {args.rdzv_endpoint}: give HOST:PORT")
        args.master_addr, args.master_port = host, int(port)
    if not args.command or args.nproc < 1 or args.spares < 0:
        ap.error("give --nproc >= 1 and a training script")
    if not 0 <= args.spare_nodes < args.nodes:
        ap.error("give 0 <= --spare-nodes < --nodes")
    if not 0 <= args.node_rank < args.nodes or (args.nodes > 1 and not args.master_port):
        ap.error("give 0 <= --node-rank < --nodes, and --master-port with several nodes")
    return args


def _job_secret(args: argparse.Namespace) -> None:
    """The job's secret must be there (made for one node; every node's the same for several):
    otherwise a one-line error, exit 2, as for a bad option."""
    try:
        job_secret = secret.ensure() if args.nodes == 1 else secret.load()
    except secret.SecretError as e:
        _refuse(str(e))
    if job_secret is None:
        _refuse(f"--nodes {args.nodes}: give every node the same job secret in {secret.SECRET_FILE_ENV} (a file) "
                f"or {secret.SECRET_ENV}, never on the command line (docs/security.md)")


def _refuse(why: str) -> None:
    print(f"python -m ckpt.inprocess.launch: error: {why}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    _job_secret(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise_fd_limit()
    with preload.starter(args) as start:  # it imports while this launcher sets up: the first workers are its forks
        return _launch(args, start)


def _launch(args: argparse.Namespace, start: Starter) -> int:
    """The job launcher (node rank 0) or a node launcher: 0 when the job ended well."""
    if args.node_rank:
        return run_node(args.node_rank, (args.master_addr, args.master_port), args.command, args.hang_s,
                        args.progress_s, start)
    # one store server for every attempt: the other nodes' launchers find each relaunch on it. torch
    # binds its own listener to every interface: it is given one bound to --master-addr alone
    listener = socket.create_server((args.master_addr, args.master_port), backlog=1024)
    base = dist.TCPStore(args.master_addr, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60), master_listen_fd=listener.detach())
    lost: set[int] = set()
    for attempt in range(args.relaunches + 1):
        job = Job(args, attempt, base, lost, start)
        ok, why, again = False, "the launcher failed", False
        try:
            ok, why = job.watch()
            again = not ok and not job.stopped and attempt < args.relaunches and job.can_relaunch()
        finally:
            job.stop("done" if ok else why, again=again)
        if ok:
            return 0
        if not again:
            log.error("the job failed: %s", why)
            return 1
        lost = job.lost
        log.error("falling back to a relaunch (attempt %d of %d) on node(s) %s: %s", attempt + 1, args.relaunches,
                  sorted(set(job.hosts.values()) - lost), why)
    return 1


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit: a launcher holds a
    connection per worker and node, and idle connections to its ports must not end it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, e)


if __name__ == "__main__":
    sys.exit(main())
