"""`ckpt ls` and `ckpt verify --manifests-only` of an N-shard checkpoint, on local disk and in
the S3 test server (moto's server mode on 127.0.0.1, as the tests start it): scale_bench's
``ckpt_ls_disk``, ``ckpt_ls_s3``, ``verify_manifests_disk`` and ``verify_manifests_s3`` rows.

The checkpoint is written through the real tiers (``write_shard`` of every rank, then ``commit``
of the commit record; in S3 the same objects put in concurrent batches, ``put_checkpoint``; the
manifests' bytes made once by the real class and patched per rank, ``Shards``): each shard
manifest lists the 723 parameters of a 70B Llama-2 model (80 layers of 9 tensors, the
embedding, the final norm, the head; bf16), each a ``Shard(0)`` DTensor over a mesh of N ranks,
with its name, global shape, layout and checksum, as FSDP saves them: the manifest bytes of a
real shard (248 KB). The rank's own rows are recorded empty, so the data files are empty
(16,384 ranks' data would be 140 GB): the components read no data anyway. Measured: the CLI's
command itself (``ckpt.cli``, in this process, ``--json``), its wall seconds, its CPU seconds
(this process's and its ended children's, ``--jobs``' workers: what a loaded machine inflates
less; moto's server runs on in another process) and, on S3, the HTTP requests it sends (counted
at aiobotocore's endpoint).
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

STEP = 1
LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
         "input_layernorm.weight", "post_attention_layernorm.weight")
HIDDEN, KV, FFN, VOCAB, LAYERS = 8192, 1024, 28672, 32000, 80
COMPONENTS = ("ckpt_ls_disk", "ckpt_ls_s3", "verify_manifests_disk", "verify_manifests_s3")
# why a row stops short of 16,384 here (scale_bench's meta, where one does; docs/scale.md)
SHORT_OF_16384 = {
    "verify_manifests_disk": "~50 ms of CPU a shard on this 2-core machine, loaded (4,096: 173 s): 16,384 shards "
                             "(~700 s, after 4 GB of manifests written) do not fit a component's 900 s",
    "verify_manifests_s3": "moto serves each request in Python (~7 ms of CPU): 16,384 shards' 32k puts, then their "
                           "GETs and parsing, take longer than a component's 900 s here",
    "ckpt_ls_disk": "none with --max-ranks 16384 (0.4 s); the default run stops at --max-ranks",
    "ckpt_ls_s3": "none with --max-ranks 16384 (6 requests at every N); the default run stops at --max-ranks",
}


def llama70b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The parameters of Llama-2-70B (GQA: 8 key/value heads), in state_dict order: 723 tensors."""
    per = {"self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (KV, HIDDEN),
           "self_attn.v_proj.weight": (KV, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
           "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
           "mlp.down_proj.weight": (HIDDEN, FFN), "input_layernorm.weight": (HIDDEN,),
           "post_attention_layernorm.weight": (HIDDEN,)}
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    out += [(f"model.layers.{i}.{name}", per[name]) for i in range(LAYERS) for name in LAYER]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def shard_manifest(rank: int, world: int):
    """Rank ``rank``'s shard manifest of the 70B model over ``world`` ranks (rows recorded empty)."""
    from ckpt.format.checksum import MIN_CHUNK_BYTES
    from ckpt.format.layout import Layout
    from ckpt.format.manifest import ShardManifest, TensorEntry
    tensors, tree = [], {}
    for i, (name, shape) in enumerate(llama70b_shapes()):
        local = (0, *shape[1:])
        runs = ((),) + tuple(((0, d),) for d in shape[1:])
        layout = Layout(shape, (world,), ("dp_shard",), ("Shard(0)",), (rank,), runs)
        tensors.append(TensorEntry(i, f"model.{name}", "bfloat16", local, 0, 0, (0,), layout))
        tree[name] = {"__dtensor__": i}
    return ShardManifest(rank, STEP, 0, 0, tensors, {"model": tree, "step": STEP}, MIN_CHUNK_BYTES, world)


class Shards:
    """Every rank's shard manifest bytes from rank 0's (``to_bytes`` of the real class), its rank,
    data file and mesh coordinate put in: one ``to_bytes`` at 16,384 ranks would take minutes here."""

    def __init__(self, world: int) -> None:
        self.template = shard_manifest(0, world).to_bytes()

    def raw(self, rank: int) -> bytes:
        from ckpt.format.manifest import shard_data_file
        return (self.template.replace(b'"coordinate":[0]', b'"coordinate":[%d]' % rank)
                .replace(b'"data_file":"rank-00000.bin"', b'"data_file":"%s"' % shard_data_file(rank).encode())
                .replace(b'"rank":0,', b'"rank":%d,' % rank, 1))


class _Empty:
    """A shard source with no data bytes, what ``write_shard`` copies from; its manifest gives
    ``to_bytes`` from ``Shards`` (the fields ``write_shard`` reads, as a ``ShardManifest`` has them),
    or, ``stub``, a few bytes that no reader would accept."""

    def __init__(self, shards: Shards, rank: int, stub: bool = False) -> None:
        from ckpt.format.manifest import shard_data_file
        self.manifest, self.location = self, "scale-bench"
        self.rank, self.data_bytes, self.data_file, self.has_checksums = rank, 0, shard_data_file(rank), True
        self.to_bytes = (lambda: b'{"stub": %d}' % rank) if stub else (lambda: shards.raw(rank))

    def view(self, offset: int, nbytes: int):
        return memoryview(b"")

    def read_into(self, offset: int, out: memoryview) -> None:
        raise AssertionError("an empty shard has no bytes to read")


def write_checkpoint(tier, world: int, threads: int = 8, stubs: bool = False) -> int:
    """Every rank's shard through ``tier.write_shard``, then the commit record: the manifest bytes of rank 0.
    ``stubs``: every rank but 0 with a stub for its manifest (``ckpt ls`` opens rank 0's only: the
    same objects to list, without writing 248 KB a shard; one it opened would read as damaged)."""
    from ckpt.format.manifest import Manifest
    from ckpt.tiers.base import CheckpointId
    cid, shards = CheckpointId(0, STEP), Shards(world)
    with ThreadPoolExecutor(threads) as pool:
        refs = list(pool.map(lambda r: tier.write_shard(cid, _Empty(shards, r, stubs and r > 0)), range(world)))
    tier.commit(cid, Manifest(STEP, 0, world, refs))
    return len(shards.template)


def put_checkpoint(tier, world: int, first_only: bool = False, batch: int = 512, tries: int = 6) -> int:
    """``write_checkpoint``'s objects in an object store, put faster: every rank's empty data object
    and its manifest under the keys ``write_shard`` uses, ``batch`` ranks an s3fs ``pipe`` (its
    concurrent puts), a batch put again after a failure (moto's server, loaded, drops connections;
    a put is idempotent), then the commit record through ``tier.commit``. ``write_shard`` sends 3
    requests a shard one shard a thread (is the step committed? data, manifest): 16,384 shards'
    took longer than the 900 s a component has here. ``first_only``: rank 0's objects and the
    N-shard commit record, no other shard's (``ckpt ls`` reads the commit record and rank 0's
    manifest, and lists the checkpoints' folders with a delimiter, never their objects: 2N
    objects into moto took over 900 s at 16,384 here)."""
    import time

    from ckpt.format.checksum import crc32c_of
    from ckpt.format.manifest import Manifest, ShardRef, shard_data_file, shard_manifest_file
    from ckpt.tiers.base import CheckpointId
    cid, shards = CheckpointId(0, STEP), Shards(world)
    refs = [ShardRef(rank, crc32c_of(shards.raw(rank)), 0) for rank in range(world)] if first_only else []
    for lo in range(0, 1 if first_only else world, batch):
        objects = {}
        for rank in range(lo, 1 if first_only else min(world, lo + batch)):
            raw = shards.raw(rank)
            objects[tier._key(cid, shard_manifest_file(rank))] = raw  # the tier's own key for it
            objects[tier._key(cid, shard_data_file(rank))] = b""
            refs += [] if first_only else [ShardRef(rank, crc32c_of(raw), 0)]
        for attempt in range(tries):
            try:
                tier.fs.pipe(objects)
                break
            except OSError:
                if attempt == tries - 1:
                    raise
                time.sleep(2 ** attempt)
    tier.commit(cid, Manifest(STEP, 0, world, refs))
    return len(shards.template)


class Requests:
    """HTTP requests sent by every aiobotocore client of this process (s3fs's), counted."""

    n = 0
    _lock = threading.Lock()
    _installed = False

    @classmethod
    def install(cls) -> None:
        """Once a process (every size after the first would count each request again)."""
        from aiobotocore.endpoint import AioEndpoint
        if cls._installed:
            return
        cls._installed, send = True, AioEndpoint._send

        async def counted(self, request):
            with cls._lock:
                cls.n += 1
            return await send(self, request)

        AioEndpoint._send = counted


def _cli(*args: str) -> str:
    """``ckpt ARGS --json`` in this process; its output (the exit code is the caller's to judge)."""
    from ckpt.cli import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli.main([*args, "--json"], prog_name="ckpt", standalone_mode=False)
        except SystemExit as e:
            if e.code:
                raise RuntimeError(f"ckpt {' '.join(args)} exited {e.code}: {out.getvalue()[-500:]}") from None
    return out.getvalue()


@contextlib.contextmanager
def _s3(server=None):
    """An S3 server (``server``, or moto's started here) with a fresh bucket: the bucket's URL, the
    CLI pointed at the server through the AWS environment, as docs/objstore.md says."""
    from tests.objstore_fixtures import create_bucket, moto_server
    with contextlib.nullcontext(server) if server is not None else moto_server() as server:
        saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
        os.environ.update(AWS_ENDPOINT_URL_S3=server.endpoint, AWS_ACCESS_KEY_ID=server.key,
                          AWS_SECRET_ACCESS_KEY=server.secret)
        try:
            yield f"s3://{create_bucket(server)}/ckpt", server.options()
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@contextlib.contextmanager
def _where(component: str, n: int, server=None):
    """The root the CLI is pointed at, holding an N-shard checkpoint: (root, manifest bytes, an
    empty memory directory)."""
    empty, stubs = tempfile.mkdtemp(prefix="scale-no-slots-"), component.startswith("ckpt_ls")
    try:
        if component.endswith("_disk"):
            from ckpt.tiers.local import LocalDiskTier
            root = tempfile.mkdtemp(prefix="scale-listing-")
            try:
                yield root, write_checkpoint(LocalDiskTier(root), n, stubs=stubs), empty
            finally:
                shutil.rmtree(root, ignore_errors=True)
            return
        from ckpt.tiers.object_store import ObjectStoreTier
        with _s3(server) as (url, options):
            tier = ObjectStoreTier(url, options)
            try:
                yield url, put_checkpoint(tier, n, first_only=stubs), empty
            finally:
                tier.close()
    finally:
        os.rmdir(empty)


def _cpu() -> float:
    """CPU seconds of this process and of its children that ended (``verify --jobs``' workers;
    not moto's server, which runs on)."""
    import resource
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                        resource.RUSAGE_CHILDREN)))


def rows() -> dict:
    """scale_bench's components of this module: name -> (N -> row)."""
    return {c: functools.partial(run_one, c) for c in COMPONENTS}


def run_one(component: str, n: int, server=None) -> dict:
    """One listing component at ``n`` shards: its timed CLI call and the fields of its row
    (``server``: an S3 server to use, as the tests' fixture gives; else moto's, started here)."""
    import time
    if component.endswith("_s3"):
        Requests.install()
    with _where(component, n, server) as (root, manifest_bytes, no_slots):
        args = ("ls", root) if component.startswith("ckpt_ls") else ("verify", root, "--manifests-only")
        if component == "verify_manifests_s3":  # in this process, where its requests are counted
            args += ("--jobs", "1")
        os.sync()  # the write-back of the N manifests just written is not the command's cost
        Requests.n = 0
        t0, c0 = time.perf_counter(), _cpu()
        out = _cli(*args, "--memory-dir", no_slots)
        seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    if component.startswith("ckpt_ls"):
        if '"status": "complete"' not in out or '"optimizers": null' in out:
            raise RuntimeError(f"ckpt ls did not list the checkpoint whole: {out[-500:]}")
    elif '"damaged": 0' not in out:
        raise RuntimeError(f"verify found damage: {out[-500:]}")
    ops = Requests.n if component.endswith("_s3") else 0
    return {"component": component, "ranks": n, "seconds": seconds, "cpu_s": cpu, "store_ops": ops, "store_keys": ops,
            "ops_per_rank": ops / n, "server_s_per_op": seconds / max(1, ops), "shard_manifest_bytes": manifest_bytes,
            "store": "s3 (moto server, 127.0.0.1)" if component.endswith("_s3") else "local disk"}
