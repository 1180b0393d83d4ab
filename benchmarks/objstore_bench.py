"""Object-store throughput: our tier against plain fsspec copies and torch.distributed.checkpoint.

One run, one S3 server on loopback, started here, the same checkpoint bytes for every
contender. The server: ``--server moto`` (moto's server mode, what the tests use: one
Python process, ~11 CPU-s per GB, so it is the bottleneck whatever the client does) or
``--server s3rver`` (the npm package s3rver on Node.js, installed on first use into
~/.cache/ckpt-guard/s3rver; several times cheaper per byte, so the clients' own
parallelism shows). ``--throttle`` puts the server behind benchmarks/throttle_proxy.py,
which caps each connection (``--throttle-MBps``, default 20) and delays each response
(``--latency-ms``, default 20), as a remote store such as S3 does: on loopback a single
stream is otherwise as fast as many.

* ours        ObjectStoreTier.write_shard+commit from the disk tier (parallel multipart),
              and restore (parallel ranged GETs, every chunk CRC-checked) into the tensors;
* fs.put/get  s3fs ``put_file``/``get_file`` of the same data file, single stream
              (``max_concurrency=1``) and with s3fs's own concurrent parts (its default);
* dcp         torch.distributed.checkpoint save/load through FsspecWriter/FsspecReader.

Reports the median of ``--repeats`` runs per contender, ratios against the
single-stream copy, and the CPU seconds per GB the server and this client spent:
on a small machine the server's CPU, not the network, is what every contender
waits for. Not a test: nothing here asserts a speed.

    PYTHONPATH=. python benchmarks/objstore_bench.py --gb 1 --repeats 3 [--server s3rver] [--json]
    PYTHONPATH=. python benchmarks/objstore_bench.py --gb 0.25 --repeats 3 --server s3rver --throttle --no-urgent --json
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import s3fs
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

from benchmarks.harness import leaves_no_shm, parser, run_meta, write_json  # noqa: E402
from ckpt import CheckpointManager  # noqa: E402
from ckpt.format.manifest import Manifest  # noqa: E402
from ckpt.restore.reshard import load_shard  # noqa: E402
from ckpt.tiers.object_store import ObjectStoreTier  # noqa: E402
from tests.objstore_fixtures import S3Server, create_bucket, moto_server  # noqa: E402
from tests.procs import cpu_seconds, free_port, stop_process  # noqa: E402

TENSOR_BYTES = 128 << 20
S3RVER = "s3rver@3.7.1"
S3RVER_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ckpt-guard" / "s3rver"


@contextmanager
def s3rver_server(data_dir: str):
    """Start s3rver (Node.js) on a free loopback port, objects under ``data_dir``; stop it on exit."""
    exe = S3RVER_DIR / "node_modules" / ".bin" / "s3rver"
    if not exe.exists():
        print(f"installing {S3RVER} into {S3RVER_DIR} (npm)", file=sys.stderr)
        subprocess.run(["npm", "install", "--prefix", str(S3RVER_DIR), "--no-audit", "--no-fund", S3RVER], check=True,
                       stdout=subprocess.DEVNULL)
    port = free_port()
    proc = subprocess.Popen([str(exe), "-d", data_dir, "-a", "127.0.0.1", "-p", str(port), "--silent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc, "s3rver")
        yield S3Server(proc, f"http://127.0.0.1:{port}", key="S3RVER", secret="S3RVER")
    finally:
        stop_process(proc)


def _wait_listening(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    """Return once ``proc`` accepts connections on loopback ``port``; raise if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start on port {port}") from None
            time.sleep(0.1)


@contextmanager
def throttled(server: S3Server, MBps: float, latency_ms: float):
    """``server`` behind benchmarks/throttle_proxy.py (a subprocess): per-connection cap, per-response
    latency. Yields the proxied server and the proxy's process."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("throttle_proxy.py")), "--port", str(port),
                             "--upstream", server.endpoint.removeprefix("http://"), "--MBps", str(MBps),
                             "--latency-ms", str(latency_ms)])
    try:
        _wait_listening(port, proc, "throttle proxy")
        yield S3Server(server.proc, f"http://127.0.0.1:{port}", key=server.key, secret=server.secret), proc
    finally:
        stop_process(proc)


@contextmanager
def start_server(args: argparse.Namespace, shm: str):
    """The server to run against, and the pids whose CPU is the store's (server, proxy)."""
    with _start_bare_server(args, shm) as server:
        if not args.throttle:
            yield server, [server.proc.pid]
            return
        with throttled(server, args.throttle_MBps, args.latency_ms) as (proxied, proxy):
            yield proxied, [server.proc.pid, proxy.pid]


@contextmanager
def _start_bare_server(args: argparse.Namespace, shm: str):
    if args.server == "s3rver":
        with s3rver_server(tempfile.mkdtemp(prefix="s3rver-", dir=shm)) as server:  # objects in memory, as moto's
            yield server
        return
    # moto spools every object over 5 MiB to a temporary file on this VM's disk; real
    # S3 has no such cost on the client's path, so by default objects stay in its memory
    env = None if args.moto_disk_spool else {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(64 << 30)}
    with moto_server(env) as server:
        yield server


@dataclass
class Sample:
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float



def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Clock:
    """Times phases of one run: wall clock, and CPU of the store's processes and of this one."""

    def __init__(self, store_pids: list[int]) -> None:
        self.pids, self.samples = store_pids, {}

    def _store_cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)

    @contextmanager
    def __call__(self, phase: str):
        s0, c0, t0 = self._store_cpu(), _own_cpu(), time.perf_counter()
        yield
        self.samples[phase] = Sample(time.perf_counter() - t0, self._store_cpu() - s0, _own_cpu() - c0)


def make_state(total: int) -> dict[str, torch.Tensor]:
    n = max(1, total // TENSOR_BYTES)
    return {f"layer{i}": torch.randn(TENSOR_BYTES // 4) for i in range(n)}


class Bench:
    def __init__(self, server, work: Path, shm: str, state: dict, part_size: int, concurrency: int) -> None:
        self.opts = server.options(read_timeout=600)  # moto needs long to assemble a GB-sized upload
        self.bucket = create_bucket(server)
        self.work, self.shm, self.state = work, shm, state
        self.part_size, self.concurrency = part_size, concurrency
        with CheckpointManager(work / "disk", memory_dir=shm, run="bench") as mgr:
            mgr.save(1, state).wait()
            self.disk = mgr.disk
        self.ckpt_id = self.disk.list()[-1].id
        self.data_file = self.disk.root / self.ckpt_id.name / "rank-00000.bin"
        self.nbytes = self.data_file.stat().st_size
        self.fs = s3fs.S3FileSystem(**self.opts)  # a plain client, as a user would make one

    def _url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:8]}"

    def _tier(self, url: str) -> ObjectStoreTier:
        return ObjectStoreTier(url, self.opts, part_size=self.part_size, concurrency=self.concurrency)

    def _blank(self) -> dict[str, torch.Tensor]:
        return {k: torch.empty_like(v) for k, v in self.state.items()}

    def _check(self, got: dict[str, torch.Tensor]) -> None:
        assert all(torch.equal(got[k], v) for k, v in self.state.items()), "download differs from the source"

    # each times an "up" and a "down" phase, and removes what it wrote

    def ours(self, clock: Clock) -> None:
        tier = self._tier(self._url("ours"))
        man = self.disk.read_manifest(self.ckpt_id)
        src = self.disk.open_shard(self.ckpt_id, man.shards[0])
        try:
            with clock("up"):
                ref = tier.write_shard(self.ckpt_id, src)
                tier.commit(self.ckpt_id, Manifest(self.ckpt_id.step, self.ckpt_id.generation, 1, [ref]))
        finally:
            src.close()
        got = self._blank()
        with clock("down"):
            values = load_shard(tier, self.ckpt_id, got)
        self._check({k: values[k] for k in got})
        tier.delete(self.ckpt_id)
        tier.close()

    def _plain(self, clock: Clock, concurrency: int) -> None:
        key = self._url("plain")
        with clock("up"):
            self.fs.put_file(str(self.data_file), key, max_concurrency=concurrency)
        out = self.work / "plain.bin"
        with clock("down"):
            self.fs.get_file(key, str(out), max_concurrency=concurrency)  # s3fs's default is 10 ranges
        assert out.stat().st_size == self.nbytes
        out.unlink()
        self.fs.rm(key)

    def plain_single(self, clock: Clock) -> None:
        self._plain(clock, 1)

    def plain_s3fs_default(self, clock: Clock) -> None:
        self._plain(clock, self.fs.max_concurrency)

    def _dcp(self, clock: Clock, threads: int) -> None:
        url = self._url("dcp")
        with clock("up"):
            dcp.save(self.state, storage_writer=FsspecWriter(url, thread_count=threads, **self.opts))
        got = self._blank()
        with clock("down"):
            dcp.load(got, storage_reader=FsspecReader(url, **self.opts))
        self._check(got)
        self.fs.rm(url, recursive=True)

    def urgent_save(self) -> dict[str, float]:
        """What a failure prediction triggers: save(urgent=True) on a manager with a disk and
        an object tier; seconds blocked, and from then to durable on disk and off-node."""
        url = self._url("urgent")
        with CheckpointManager(self.work / f"urgent-{uuid.uuid4().hex[:6]}", object_store=self._tier(url),
                               memory_dir=self.shm, run=uuid.uuid4().hex[:8]) as mgr:
            h = mgr.save(1, self.state, urgent=True)
            h.wait()
            shutil.rmtree(mgr.disk.root)
        self.fs.rm(url, recursive=True)
        return {"blocking_s": h.blocking_s, **{f"{tier}_s": s for tier, s in h.durable_s.items()}}

    def dcp_1_thread(self, clock: Clock) -> None:
        self._dcp(clock, 1)

    def dcp_n_threads(self, clock: Clock) -> None:
        self._dcp(clock, self.concurrency)


CONTENDERS = {
    "ours": ("ours (parallel multipart / ranged GETs, verified)", Bench.ours),
    "put1": ("fs.put_file / fs.get_file, single stream", Bench.plain_single),
    "put": ("fs.put_file (s3fs concurrent parts) / fs.get_file", Bench.plain_s3fs_default),
    "dcp1": ("torch DCP FsspecWriter/Reader, 1 thread", Bench.dcp_1_thread),
    "dcpN": ("torch DCP FsspecWriter/Reader, N threads", Bench.dcp_n_threads),
}


def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="objstore-bench-"))
    shm = tempfile.mkdtemp(prefix="objstore-bench-", dir="/dev/shm")  # memory slots where they live in training
    chosen = args.only or list(CONTENDERS)
    runs: dict[str, list[dict[str, Sample]]] = {c: [] for c in chosen}
    urgent: list[dict[str, float]] = []
    try:
        state = make_state(int(args.gb * (1 << 30)))
        with start_server(args, shm) as (server, store_pids):
            bench = Bench(server, work, shm, state, args.part_mib << 20, args.concurrency)
            total = args.repeats * (len(chosen) + (not args.no_urgent))
            with tqdm(total=total, desc="transfers", unit="run", disable=args.json == "-") as bar:
                for _ in range(args.repeats):  # round-robin, so drift hits every contender alike
                    for c in chosen:
                        clock = Clock(store_pids)
                        CONTENDERS[c][1](bench, clock)
                        runs[c].append(clock.samples)
                        bar.update()
                    if not args.no_urgent:
                        urgent.append(bench.urgent_save())
                        bar.update()
        leaves_no_shm(shm)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    gb = bench.nbytes / 1e9
    rows = {}
    for c, samples in runs.items():
        row: dict = {"what": CONTENDERS[c][0]}
        for phase in ("up", "down"):
            med = {k: statistics.median(getattr(s[phase], k) for s in samples)
                   for k in ("wall_s", "server_cpu_s", "client_cpu_s")}
            row[phase] = {"MBps": bench.nbytes / 1e6 / med["wall_s"], "median_s": med["wall_s"],
                          "server_cpu_s_per_GB": med["server_cpu_s"] / gb,
                          "client_cpu_s_per_GB": med["client_cpu_s"] / gb,
                          "runs": [asdict(s[phase]) for s in samples]}
        rows[c] = row
    for row in rows.values():
        for phase in ("up", "down"):
            row[phase]["x_single"] = (rows["put1"][phase]["median_s"] / row[phase]["median_s"]
                                      if "put1" in rows else None)
    server = ("s3rver (Node.js) on loopback, objects in /dev/shm" if args.server == "s3rver" else
              "moto_server on loopback, "
              + ("objects spooled to disk" if args.moto_disk_spool else "objects in memory"))
    if args.throttle:
        server += f", behind a proxy capping each connection at {args.throttle_MBps:g} MB/s each way, " \
                  f"+{args.latency_ms:g} ms per response (server CPU includes the proxy's)"
    throttle = {"MBps_per_connection": args.throttle_MBps, "latency_ms": args.latency_ms} if args.throttle else None
    return {"bytes": bench.nbytes, "repeats": args.repeats, "part_size": args.part_mib << 20, "throttle": throttle,
            "concurrency": args.concurrency, "server": server, "results": rows,
            "urgent_save": {k: statistics.median(u[k] for u in urgent) for k in urgent[0]} if urgent else None}


def print_table(report: dict) -> None:
    print(f"\n{report['bytes'] / 1e9:.2f} GB checkpoint, median of {report['repeats']}, part "
          f"{report['part_size'] >> 20} MiB x {report['concurrency']} in flight, {report['server']}, "
          f"{report['meta']['machine']}, load average after {report['meta']['load_after'][0]:.1f}\n")
    head = "MB/s | x single | server CPU s/GB | client CPU s/GB"
    print(f"| {'contender':<52} | upload {head} | download {head} |")
    print(f"|{'-' * 54}|" + "---:|" * 8)
    for r in report["results"].values():
        cells = []
        for phase in ("up", "down"):
            p = r[phase]
            x = f"{p['x_single']:.2f}" if p["x_single"] else "-"
            cells += [f"{p['MBps']:.0f}", x, f"{p['server_cpu_s_per_GB']:.1f}", f"{p['client_cpu_s_per_GB']:.1f}"]
        print(f"| {r['what']:<52} | " + " | ".join(cells) + " |")
    if report["urgent_save"]:
        u = report["urgent_save"]
        print(f"\nurgent save (median): blocked {u['blocking_s']:.2f} s; durable on disk {u['disk_s']:.1f} s "
              f"and off-node {u['object_s']:.1f} s after save() returned")


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.split("\n\n")[0], repeats=3)
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    p.add_argument("--part-mib", type=int, default=32, help="our part and range size in MiB")
    p.add_argument("--concurrency", type=int, default=8, help="our parts/ranges in flight (and DCP's N threads)")
    p.add_argument("--only", nargs="+", choices=list(CONTENDERS), help="run only these contenders")
    p.add_argument("--server", choices=["moto", "s3rver"], default="moto", help="the S3 server to start on loopback")
    p.add_argument("--moto-disk-spool", action="store_true",
                   help="leave moto's default of spooling objects to temporary files (slower, noisier)")
    p.add_argument("--throttle", action="store_true",
                   help="run behind benchmarks/throttle_proxy.py: a cap per connection, latency per response")
    p.add_argument("--throttle-MBps", type=float, default=20.0,
                   help="with --throttle: MB/s per connection and direction (default 20)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="with --throttle: ms added per response (default 20)")
    p.add_argument("--no-urgent", action="store_true", help="skip the urgent-save measurement")
    args = p.parse_args(argv)
    meta = run_meta()
    report = write_json(args.json, meta, **run(args))
    if args.json != "-":
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
