"""``ckpt``: list, verify, restore and clean checkpoints after a fault; export and import
them for other tools; simulate goodput.

Exit codes: 0 ok, 1 failure (damaged, nothing to restore), 2 usage. Every command
takes ``--json`` for scripts; progress bars appear only on a terminal.
"""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager, suppress
from typing import Iterator

import click
from tqdm import tqdm

from telemetry.cli_group import role_group

from .errors import CheckpointError, DamagedCheckpoint
from .restore.copy_into import copy_verified
from .restore.execute import DAMAGE, LOCAL, restore_agreed
from .restore.listing import merge_listing, optimizer_layouts, shm_usage
from .restore.plan import Inventory, RestorePlan, ShardNeed
from .restore.verdicts import apply_verdicts, read_verdicts, record_verdicts
from .simulate_cli import simulate_cmd
from .tiers.base import CheckpointId, complete_shards
from .tiers.fsutil import made_for
from .tiers.local import LocalDiskTier
from .tiers.locations import durable_tier_for, is_url, tiers_for
from .tiers.manifest_jobs import default_jobs, verify_manifests
from .tiers.memory import DEFAULT_SHM_DIR, namespaces_of_root, sweep_orphans

_root = click.argument("root")
_run = click.option("--run", default=None, help="Run id the job used (selects its shared-memory slots).")
_memdir = click.option("--memory-dir", default=DEFAULT_SHM_DIR, show_default=True, help="Shared-memory directory.")
_json = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


class _Group(role_group("train")):
    """Errors as every command reports them (``error: …``); a refusal of the engine is one of them."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except CheckpointError as e:
            raise click.ClickException(str(e)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Inspect and recover ckpt-guard checkpoints."""


def _emit(as_json: bool, payload: object, text: str) -> None:
    click.echo(json.dumps(payload, indent=2) if as_json else text)


@contextmanager
def _progress(total: int, desc: str, quiet: bool) -> Iterator[tqdm]:
    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              disable=quiet or not sys.stderr.isatty(), file=sys.stderr) as bar:
        yield bar


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@cli.command("ls")
@click.argument("root", required=False)
@_run
@_memdir
@click.option("--memory", is_flag=True, help="Instead of one ROOT: the shared memory every job holds on this node.")
@_json
def ls_cmd(root: str | None, run: str | None, memory_dir: str, memory: bool, as_json: bool) -> None:
    """List checkpoints: step, time, size, tiers holding them, status, health (verified, ok,
    unchecked, suspect, unhealthy, tainted: docs/sound-state.md). With --memory: each
    namespace in the memory directory, its bytes, owner, whether the owner lives and whether
    its newest step is durable elsewhere (docs/engine.md, "Shared memory on a node")."""
    if memory or root is None:
        if root is not None or not memory:
            raise click.UsageError("Missing argument 'ROOT' (or --memory for the node's shared memory)")
        _ls_memory(memory_dir, as_json)
        return
    _must_exist(root)
    tiers = tiers_for(root, run=run, memory_dir=memory_dir)
    listed = [tier.list() for tier in tiers]  # each commit record read once: the index of its shards
    rows = merge_listing(tiers, listed)
    rows = rows if is_url(root) else apply_verdicts(rows, read_verdicts(root))
    for r in rows:
        if r["status"] == "complete":
            # "by position": restores only when asked (match_by_position)
            r["optimizers"] = optimizer_layouts(tiers, r, listed)
    lines = [f"{'STEP':>10}  {'GEN':>3}  {'CREATED (UTC)':19}  {'SIZE':>10}  {'TIERS':16}  {'PEER':10}  "
             f"{'HEALTH':10}  STATUS"]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created"]))
        status = r["status"] + "".join(f"; {t}: {e}" for t, e in r["damaged"].items())
        status += "".join(f"; {k}: optimizer state by position" for k, how in (r.get("optimizers") or {}).items()
                          if how == "by position")
        if r.get("reason"):
            status += f"; {r['reason']}"
        peer = "rank " + ",".join(map(str, r["peer"])) if r["peer"] else "-"
        lines.append(f"{r['step']:>10}  {r['generation']:>3}  {when}  {_size(r['bytes']):>10}  "
                     f"{','.join(r['tiers']) or '-':16}  {peer:10}  {r['health']:10}  {status}")
    shm = shm_usage(tiers)
    if shm["peer"]:
        lines.append(f"shared memory on this node: {_size(shm['memory'])} in this job's slots, {_size(shm['peer'])} "
                     "in peer replica slots (PEER: whose shards it holds for other nodes)")
    _emit(as_json, rows, "\n".join(lines) if rows else f"no checkpoints in {root}")


def _ls_memory(memory_dir: str, as_json: bool) -> None:
    from .tiers.memory.owners import grace_s, survey

    rows = [h.describe(grace_s()) for h in survey(memory_dir)]
    lines = [f"{'NAMESPACE':36}  {'SIZE':>10}  {'USER':8}  {'PID':>7}  {'RUN':10}  {'STATE':11}  {'STEP':>8}  "
             "DURABLE  ROOT"]
    for r in rows:
        lines.append(f"{os.path.basename(r['namespace']):36}  {_size(r['bytes']):>10}  {r['user']:8}  "
                     f"{r['pid'] or '-':>7}  {str(r['run'] or '-')[:10]:10}  {r['state']:11}  "
                     f"{'-' if r['newest_step'] is None else r['newest_step']:>8}  "
                     f"{'yes' if r['durable_elsewhere'] else 'no':7}  {r['root'] or '-'}")
    dead = sum(r["bytes"] for r in rows if not r["owner_alive"])
    lines.append(f"{_size(sum(r['bytes'] for r in rows))} in {len(rows)} namespace(s), {_size(dead)} of it held by "
                 "jobs that are gone")
    _emit(as_json, rows, "\n".join(lines) if rows else f"no checkpoint shared memory in {memory_dir}")


@cli.command("verify")
@_root
@click.option("--step", type=int, default=None, help="Only this step.")
@click.option("--manifests-only", is_flag=True,
              help="Read no data: check each shard manifest against the commit record and each data file's size.")
@click.option("--jobs", type=click.IntRange(1), default=None,
              help="Processes checking manifests with --manifests-only (default: this host's cores).")
@_run
@_memdir
@_json
def verify_cmd(root: str, step: int | None, manifests_only: bool, jobs: int | None, run: str | None,
               memory_dir: str, as_json: bool) -> None:
    """Check every checksum of every copy; exit 1 naming the damaged files. With --manifests-only,
    a quick look that reads no data (status "manifests ok"): not recorded as verified for ls."""
    _must_exist(root)
    tiers = tiers_for(root, run=run, memory_dir=memory_dir)
    results = []
    for tier in tiers:
        for info in tier.list():
            if step is not None and info.id.step != step:
                continue
            row = {"step": info.id.step, "generation": info.id.generation, "tier": tier.name}
            if not info.complete:
                row.update(status="damaged", file=tier.location, reason=info.error)
            else:
                try:
                    if manifests_only:  # the durable tier's on many cores; memory slots are few
                        verify_manifests(tier, root, info.id, jobs=(jobs or default_jobs()) if tier is tiers[-1] else 1)
                        row["status"] = "manifests ok"
                    else:
                        with _progress(info.bytes, f"verify {info.id.step} ({tier.name})", as_json) as bar:
                            ok = tier.verify(info.id, progress=bar.update)
                        row["status"] = "ok" if ok else "unverified (sealed; checksums still being computed)"
                except DamagedCheckpoint as e:
                    row.update(status="damaged", file=e.file, reason=e.reason)
                except DAMAGE as e:
                    row.update(status="damaged", file=tier.location, reason=str(e))
            results.append(row)
    damaged = [r for r in results if r["status"] == "damaged"]
    kept = damaged if manifests_only else results  # a look at the manifests does not make a step "checked"
    if kept and not is_url(root):
        with suppress(OSError):  # a read-only root: the verdict is printed, not kept for ls
            record_verdicts(root, kept)
    lines = [f"step {r['step']} ({r['tier']}): {r['status']}"
             + (f": {r['file']}: {r['reason']}" if r["status"] == "damaged" else "")
             for r in sorted(results, key=lambda r: (r["generation"], r["step"]))]
    if not results:
        lines = [f"no checkpoints{'' if step is None else f' for step {step}'} in {root}"]
    _emit(as_json, {"checkpoints": results, "damaged": len(damaged)}, "\n".join(lines))
    if damaged or (not results and step is not None):
        sys.exit(1)


@cli.command("restore")
@_root
@click.option("--step", type=int, default=None, help="Restore this step (default: newest valid).")
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False), help="Directory to materialise into.")
@click.option("--force", is_flag=True, help="Write into DEST even if it already holds checkpoints.")
@_run
@_memdir
@_json
def restore_cmd(root: str, step: int | None, dest: str, force: bool, run: str | None, memory_dir: str,
                as_json: bool) -> None:
    """Copy the newest verified checkpoint (or --step) into DEST, loadable by CheckpointManager(DEST)."""
    _must_exist(root)
    target = LocalDiskTier(dest)
    already = {i.id for i in target.list()}
    if already and not force:
        raise click.UsageError(f"{dest} already holds {len(already)} checkpoint(s); pass --force to add to it")
    linked = [p for p in target.root.iterdir() if CheckpointId.parse(p.name) and p.is_symlink()] \
        if target.root.is_dir() else []
    if linked:  # writing a step there would write wherever it points
        raise CheckpointError(f"{linked[0]} is a symlink; refusing to restore through it (remove it first)")
    with made_for(dest):  # a restore that fails leaves no folder it made
        _restore_into(root, step, target, already, run, memory_dir, as_json)


def _restore_into(root: str, step: int | None, target: LocalDiskTier, already: set, run: str | None,
                  memory_dir: str, as_json: bool) -> None:
    """The restore itself, into a DEST that exists: split out so that a failure removes a DEST made for it."""
    def copy(plan: RestorePlan) -> None:
        total = 2 * sum(r.data_bytes for s in plan.shards for r in s.sources[0].read_manifest(plan.ckpt_id).shards
                        if r.rank == s.rank)  # copied, then verified
        try:
            with _progress(total, f"restore step {plan.ckpt_id.step}", as_json) as bar:
                copy_verified(plan, target, bar.update)
        except BaseException:
            if plan.ckpt_id not in already:
                target.delete(plan.ckpt_id)  # the uncommitted part copy
            raise

    skipped: list[dict] = []

    def skip(ckpt_id: CheckpointId, reason: str) -> None:
        skipped.append({"step": ckpt_id.step, "generation": ckpt_id.generation, "reason": reason})
        click.echo(f"skipping step {ckpt_id.step}: {reason}", err=True)

    found = restore_agreed(LOCAL, Inventory(tiers_for(root, run=run, memory_dir=memory_dir)),
                           lambda world: [ShardNeed(r) for r in range(world)], copy, step=step, on_skip=skip)
    if found is None:
        what = "" if step is None else f" for step {step}"
        raise click.ClickException(f"no checkpoint{what} in {root}")
    plan = found[0]
    out = {"step": plan.ckpt_id.step, "generation": plan.ckpt_id.generation,
           "from": sorted({s.sources[0].name for s in plan.shards}), "to": str(target.root), "skipped": skipped}
    _emit(as_json, out, f"restored step {out['step']} from {', '.join(out['from'])} into {out['to']}")


def _must_exist(root: str) -> None:
    """A local root that does not exist is a typo, not an empty checkpoint list."""
    if not is_url(root) and not os.path.isdir(root):
        raise click.UsageError(f"{root}: not a directory (ROOT is the directory a run checkpoints into)"
                               if os.path.exists(root) else f"{root}: no such directory")


@cli.command("export")
@_root
@click.option("--step", type=int, default=None, help="Export this step (default: newest valid).")
@click.option("--format", "fmt", type=click.Choice(["safetensors", "dcp"]), required=True,
              help="safetensors: the model's weights, unsharded; dcp: the whole state for "
                   "torch.distributed.checkpoint.")
@click.option("--to", "dest", required=True, type=click.Path(file_okay=False), help="Directory to write into.")
@click.option("--key", default=None, help="safetensors: the state key holding the model (default: model, state_dict).")
@click.option("--max-shard-size", type=int, default=5 * 10**9, show_default=True,
              help="safetensors: bytes per file; larger models get numbered shards and an index.")
@click.option("--force", is_flag=True, help="Write into DEST even if it is not empty.")
@_run
@_json
def export_cmd(root: str, step: int | None, fmt: str, dest: str, key: str | None, max_shard_size: int, force: bool,
               run: str | None, as_json: bool) -> None:
    """Write a checkpoint for other tools: safetensors weights (inference, Hugging Face) or a DCP directory."""
    from pathlib import Path

    from .interop import export
    from .restore.reshard import read_whole

    _must_exist(root)
    out = Path(dest)
    if out.exists() and any(out.iterdir()) and not force:
        raise click.UsageError(f"{dest} is not empty; pass --force to write into it")
    # sharded tensors assembled from every saved shard; DCP gets the names get_state_dict gives
    ckpt_id, values = read_whole(root, step, run=run, by_name=fmt == "dcp")
    if fmt == "dcp":
        def write(into: Path) -> list[Path]:
            export.write_dcp(values, into)
            return sorted(into.iterdir())
    else:
        weights = export.model_weights(values, key)
        meta = {"ckpt_guard_step": str(ckpt_id.step), "ckpt_guard_generation": str(ckpt_id.generation)}

        def write(into: Path) -> list[Path]:
            written = export.write_safetensors(weights, into, max_shard_bytes=max_shard_size, metadata=meta)
            return [p for p in [*written, export.write_hf_config(values, into)] if p is not None]
    files = [str(p) for p in export.write_replacing(out, write)]
    result = {"step": ckpt_id.step, "generation": ckpt_id.generation, "format": fmt, "files": files}
    _emit(as_json, result, f"exported step {ckpt_id.step} as {fmt} into {dest} ({len(files)} file(s))")


@cli.command("import")
@click.argument("source", type=click.Path(exists=True, file_okay=False))
@click.option("--from", "fmt", type=click.Choice(["dcp"]), required=True,
              help="dcp: a torch.distributed.checkpoint directory (torchtitan, FSDP2, dcp.save), any number of ranks.")
@click.option("--to", "dest", required=True, help="Checkpoint root to write into (a directory or an object-store URL).")
@click.option("--step", type=int, default=None,
              help="Step to record (default: the number ending SOURCE's name, as in torchtitan's step-1000).")
@click.option("--force", is_flag=True, help="Write into a root that holds checkpoints; the import becomes the newest.")
@click.option("--run", default="default", show_default=True, help="Run id of the job that will resume from it.")
@_json
def import_cmd(source: str, fmt: str, dest: str, step: int | None, force: bool, run: str, as_json: bool) -> None:
    """Make another tool's checkpoint one of ours: its tensors unsharded and its plain
    values, as a one-rank checkpoint (checksummed, committed) that ckpt.load and a
    CheckpointManager restore. Pickled items are refused, never unpickled."""
    import re

    from .interop import dcp_import
    from .interop.offline_write import import_target, write_state
    from .restore.optim_names import saved_layouts

    if step is None:
        found = re.search(r"(\d+)$", os.path.basename(os.path.normpath(source)))
        if found is None:
            raise click.UsageError(f"{source}: no step number at the end of its name; pass --step")
        step = int(found.group(1))
    metadata = dcp_import.read_metadata(source)
    tier = durable_tier_for(dest)
    ckpt_id = import_target(tier, step, run=run, replace=force)
    total = dcp_import.tensor_bytes(metadata)
    with _progress(3 * total, f"import step {step}", as_json) as bar:  # read, checksummed, written
        state = dcp_import.read_dcp(source, metadata, progress=bar.update)
        if not is_url(dest):
            os.makedirs(dest, exist_ok=True)
        write_state(tier, ckpt_id, state, run=run, progress=bar.update)
    optimizers = saved_layouts(state, {})  # "by position": restores only into ckpt.match_by_position(optim)
    out = {"step": ckpt_id.step, "generation": ckpt_id.generation, "from": source, "to": tier.location,
           "items": len(metadata.state_dict_metadata), "bytes": total, "optimizers": optimizers}
    positional = [k for k, how in optimizers.items() if how == "by position"]
    _emit(as_json, out, f"imported {source} as step {ckpt_id.step} (generation {ckpt_id.generation}) into "
          f"{tier.location} ({_size(total)} of tensors)" + "".join(
              f"\n{k}: optimizer state by position (optimizer.state_dict()); it restores only into "
              f"ckpt.match_by_position(optimizer)" for k in positional))


@cli.command("gc")
@click.argument("root", required=False)
@click.option("--keep", type=click.IntRange(min=1), default=None, help="Keep only the N newest complete checkpoints.")
@click.option("--grace", type=float, default=600.0, show_default=True,
              help="Leave unfinished writes younger than this many seconds (a live job may own them).")
@click.option("--orphans", is_flag=True, help="Instead of one ROOT: every shared-memory namespace of this user whose "
              "job is gone (root deleted, or steps durable there).")
@click.option("--force", is_flag=True, help="Also drop orphaned memory slots holding steps not on disk.")
@_memdir
@_json
def gc_cmd(root: str | None, keep: int | None, grace: float, orphans: bool, force: bool, memory_dir: str,
           as_json: bool) -> None:
    """Remove leftovers of interrupted saves, memory slots whose job is gone (once their
    steps are on disk, or in the job's object store: peer replicas), and, with --keep,
    old checkpoints. With --orphans and no ROOT: reclaim the shared memory of every job
    of this user that is gone."""
    if orphans:
        if root is not None or keep is not None:
            raise click.UsageError("--orphans takes no ROOT and no --keep")
        _gc_orphans(memory_dir, force, as_json)
        return
    if root is None:
        raise click.UsageError("give a ROOT, or --orphans")
    _must_exist(root)
    disk = durable_tier_for(root)  # the disk, or the object store at a URL
    removed = disk.cleanup(min_age_s=grace)
    on_disk = complete_shards(disk)
    if not is_url(root):
        from .save.sweep import durable_elsewhere

        spaces = namespaces_of_root(os.path.realpath(root), memory_dir)
        removed += sweep_orphans(spaces, on_disk | durable_elsewhere(spaces), force=force)
    deleted = [i.step for i in disk.prune(keep)] if keep is not None else []
    out = {"leftovers_removed": removed, "checkpoints_deleted": deleted}
    _emit(as_json, out, f"removed {len(removed)} leftover(s); deleted {len(deleted)} old checkpoint(s)"
          + (f": steps {', '.join(map(str, deleted))}" if deleted else ""))


def _gc_orphans(memory_dir: str, force: bool, as_json: bool) -> None:
    from .save.sweep import sweep_orphaned_jobs

    removed, kept = sweep_orphaned_jobs(memory_dir, force=force)
    rows = {"removed": [{"namespace": str(o.namespace), "root": o.root, "bytes": o.bytes, "why": o.reason}
                        for o in removed],
            "kept": [{"namespace": str(o.namespace), "root": o.root, "bytes": o.bytes, "why": o.reason} for o in kept]}
    lines = [f"removed {o.namespace} ({_size(o.bytes)}): {o.reason}" for o in removed]
    lines += [f"kept {o.namespace} ({_size(o.bytes)}): {o.reason}" for o in kept]
    lines.append(f"reclaimed {_size(sum(o.bytes for o in removed))} in {len(removed)} orphaned namespace(s)")
    _emit(as_json, rows, "\n".join(lines))


cli.add_command(simulate_cmd)


def main() -> None:
    """Errors exit 1 (2: usage), one line ``error: …``; with --json they are JSON, as the output a script parses."""
    cli()


if __name__ == "__main__":
    main()
