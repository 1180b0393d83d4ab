"""Quarantine: a node that keeps failing is kept out of the job's later restarts.

Each restart's timing records (``ckpt.restarts``) name the nodes to blame: a hung
rank's node, a node the predictor reported failed. Every rank reads its node's record
of past strikes before the restart's gather, so every rank decides from the same data
(the union of the nodes' records plus the new strikes) and the decision agrees
everywhere: a node with ``strikes`` strikes within ``window_s`` is quarantined. Then
every rank logs which node and why; the quarantined node's ranks stop their torchrun
agent (SIGTERM: it leaves without closing the rendezvous) and every rank exits with
``EXIT_QUARANTINED``, so the other agents restart without it (an elastic job goes on
with fewer nodes; a fixed-size one waits for a replacement node to join).

The record is a JSON file per job beside the checkpoints (``<root>/quarantine-<run>.json``,
node-local or shared; one writer per node, under a lock). A launch script can keep a
quarantined node's agent from joining at all (``python -m ckpt.quarantine check``, exit
88), and an operator clears a node once repaired (``python -m ckpt.quarantine clear``).
``check --ranking SCORES.csv --top K`` also holds the K riskiest nodes of a fault-history
ranking (``predictor nodes rank``'s ``node_id,probability``) out before they fail again.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from telemetry.faults import ranked

from ..errors import ManifestError
from ..format.bounded_json import loads_bounded
from .leaving import flush_logs

log = logging.getLogger(__name__)

EXIT_QUARANTINED = 88  # this rank left the job: a node of the job is quarantined
_MAX_RECORD_BYTES = 16 << 20
_CLOCK_SKEW_S = 300.0  # a strike stamped later than now by more than this is not believed


def record_path(root: str | os.PathLike, run: str) -> Path:
    return Path(root) / f"quarantine-{run}.json"


def read(path: Path) -> dict[str, list[dict]]:
    """node -> its strikes ({"t", "cause", "restart"}, oldest first); {} when none. A
    record that is not of this shape is ignored, and so are the malformed strikes of one
    that is, each time with one logged line: a damaged record never stops the job."""
    try:
        doc = loads_bounded(path.read_bytes(), f"quarantine record {path}", 8, _MAX_RECORD_BYTES)
    except FileNotFoundError:
        return {}
    except (OSError, ManifestError) as e:
        log.warning("quarantine record ignored: %s", e)
        return {}
    strikes = doc.get("strikes") if isinstance(doc, dict) else None
    if not isinstance(strikes, dict):
        log.warning('quarantine record %s ignored: not {"strikes": {node: [strike, ...]}}', path)
        return {}
    out, dropped = {}, 0
    for node, ss in strikes.items():
        good = [s for s in ss if _is_strike(s)] if isinstance(ss, list) else []
        dropped += (len(ss) if isinstance(ss, list) else 1) - len(good)
        if good:
            out[node] = good
    if dropped:
        log.warning("quarantine record %s: %d malformed strike(s) ignored (each needs a finite number t, a text "
                    "cause and a restart)", path, dropped)
    return out


def _is_strike(s: object) -> bool:
    return isinstance(s, dict) and type(s.get("t")) in (int, float) and math.isfinite(s["t"]) \
        and isinstance(s.get("cause"), str) and type(s.get("restart")) in (int, str)


def merge(records: list[dict[str, list[dict]]], new: dict[str, dict]) -> dict[str, list[dict]]:
    """Every node's strikes from several nodes' records plus ``new`` (node -> strike);
    one strike per node and restart, whatever the number of copies."""
    out: dict[str, dict[str, dict]] = {}
    for record in [*records, {n: [s] for n, s in new.items()}]:
        for node, strikes in record.items():
            for strike in strikes:
                out.setdefault(node, {})[strike["restart"]] = strike
    return {node: sorted(by_restart.values(), key=lambda s: s["t"]) for node, by_restart in out.items()}


def quarantined(strikes: dict[str, list[dict]], *, limit: int, window_s: float,
                now: float | None = None) -> dict[str, list[dict]]:
    """The nodes with ``limit`` strikes or more within ``window_s``: their recent strikes (a
    strike stamped in the future, beyond clock skew, would never age out: not counted)."""
    now = time.time() if now is None else now
    recent = {node: [s for s in ss if -_CLOCK_SKEW_S <= now - s["t"] <= window_s] for node, ss in strikes.items()}
    return {node: ss for node, ss in recent.items() if limit > 0 and len(ss) >= limit}


def write(path: Path, strikes: dict[str, list[dict]]) -> None:
    """Merge ``strikes`` into the record at ``path`` (a lock against the other nodes' writers
    when the root is shared)."""
    with _locked(path):
        merged = merge([read(path), strikes], {})
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"strikes": merged}, indent=1))
        os.replace(tmp, path)


def strike(path: Path, node: str, cause: str, step: int) -> None:
    """One strike against ``node`` now, outside a restart (a replica of it disagreed at ``step``,
    ``ckpt/save/soundness.py``): counted with the others at the next restart's decision."""
    write(path, {node: [{"t": time.time(), "cause": cause[:300], "restart": f"step-{step}"}]})


def clear(path: Path, node: str) -> bool:
    """Forget ``node``'s strikes (an operator repaired it); False when it had none."""
    with _locked(path):
        strikes = read(path)
        if strikes.pop(node, None) is None:
            return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"strikes": strikes}, indent=1))
        os.replace(tmp, path)
        return True


def enforce(path: Path, records_by_node: list[dict[str, list[dict]]], restart: list[dict], nodes: list[str],
            me: str, *, limit: int, window_s: float, barrier: Callable[[], None],
            exit: Callable[[int], None] = os._exit) -> None:
    """At an incarnation's start, on every rank: add the last restart's strikes (from its
    timing ``restart`` records) to the nodes' records (each rank's node's, gathered),
    write them to this node's record, and leave if a node of the job is now quarantined.
    Every rank decides from the same gathered data, so all agree."""
    blamed = sorted({n for r in restart if r.get("ev") == "fault" for n in r.get("culprits", ())})
    faults = [r for r in restart if r.get("ev") == "fault"]
    new = {n: {"t": min(f["t"] for f in faults), "cause": faults[0]["cause"][:300], "restart": faults[0]["inc"]}
           for n in blamed}
    strikes = merge(records_by_node, new)
    if new and os.environ.get("LOCAL_RANK", "0") == "0":  # one writer per node
        write(path, strikes)
    held = {n: ss for n, ss in quarantined(strikes, limit=limit, window_s=window_s).items() if n in nodes}
    for node, ss in held.items():
        log.warning("node %s: %d strike(s) in the last %.0f s: %s", node, len(ss), window_s,
                    "; ".join(s["cause"] for s in ss))
    if held:
        barrier()  # every node's record is written before anyone leaves
        node = min(held, key=lambda n: n != me)  # this node first: its agent must go
        leave(node, me, f"{len(held[node])} strikes within {window_s:.0f} s", path, exit)


def leave(node: str, me: str, why: str, path: Path, exit: Callable[[int], None] = os._exit) -> None:
    """Every rank of a job with a quarantined ``node``: log, stop this node's torchrun
    agent if it is the quarantined one, exit with EXIT_QUARANTINED."""
    log.critical("node %s is quarantined (%s): it is kept out of the job's restarts%s; clear it once repaired "
                 "with `python -m ckpt.quarantine clear --record %s --node %s`; exiting with code %d", node, why,
                 " (this node: stopping its torchrun agent)" if node == me else "", path, node, EXIT_QUARANTINED)
    flush_logs()
    if node == me and "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun leaves without closing the rendezvous
        except OSError as e:
            log.error("cannot stop this node's agent (pid %d): %s", os.getppid(), e)
    exit(EXIT_QUARANTINED)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckpt.quarantine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("list", "check", "clear"),
                    help="list the strikes; check: exit 88 if --node is quarantined; clear --node's strikes")
    ap.add_argument("--record", required=True, help="the job's record: <root>/quarantine-<run>.json")
    ap.add_argument("--node", default=None)
    ap.add_argument("--strikes", type=int, default=3, help="strikes that quarantine a node (HangDetection's)")
    ap.add_argument("--window-s", type=float, default=3600.0)
    ap.add_argument("--ranking", default=None, help="a node ranking CSV (node_id,probability: predictor nodes rank)")
    ap.add_argument("--top", type=int, default=0, help="with --ranking: its top nodes are quarantined too")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    path = Path(args.record)
    try:
        risky = ranked(Path(args.ranking), args.top) if args.ranking else {}
    except ValueError as e:
        ap.exit(2, f"error: {e}\n")
    if args.command != "list" and not args.node:
        ap.error(f"{args.command} needs --node")
    if args.command == "clear":
        done = clear(path, args.node)
        print(json.dumps({"node": args.node, "cleared": done}) if args.json else
              f"{args.node}: {'strikes cleared' if done else 'no strikes on record'}")
        return 0
    strikes = read(path)
    out = quarantined(strikes, limit=args.strikes, window_s=args.window_s)
    out |= {n: [{"t": time.time(), "cause": f"ranked among the top {args.top} (probability {p:.3f})",
                 "restart": "ranking"}] for n, p in risky.items() if n not in out}
    if args.command == "check":
        held = args.node in out
        print(json.dumps({"node": args.node, "quarantined": held, "strikes": out.get(args.node, [])}) if args.json
              else f"{args.node}: {'QUARANTINED' if held else 'ok'}", file=sys.stdout if args.json else sys.stderr)
        return EXIT_QUARANTINED if held else 0
    if args.json:
        print(json.dumps({"strikes": strikes, "quarantined": sorted(out)}))
    else:
        for node, ss in sorted(({n: out[n] for n in risky} | strikes).items()):
            print(f"{node}: {len(ss)} strike(s){' QUARANTINED' if node in out else ''}; last: {ss[-1]['cause']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
