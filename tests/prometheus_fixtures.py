"""A real Prometheus holding a simulated trace: the trace written as dcgm-exporter series in
OpenMetrics, backfilled with `promtool tsdb create-blocks-from openmetrics`, served on
127.0.0.1 from that storage (retention 100 years: older blocks are deleted at start-up)."""
from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import requests

from telemetry import dcgm
from telemetry.schema import METRICS, XID_ERRORS
from tests.procs import LoopbackHTTP, free_port, stop_process, wait_for, write_dripping


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:   # fail, not skip (scripts/apt-packages.txt installs it)
        pytest.fail(f"{binary} not found: install the Debian package prometheus")
    return path


def _sec(t_ms: int) -> str:
    return f"{t_ms // 1000}.{t_ms % 1000:03d}"


def write_openmetrics(trace: Path, out: Path) -> None:
    """Every telemetry field as a gauge series per GPU with dcgm-exporter's labels, and the XID
    gauge holding the last XID: sampled at each XID and at each of the GPU's scrapes."""
    tel = pq.read_table(trace / "telemetry.parquet")
    tel = pa.table({c: pc.cast(tel.column(c), pa.string()) if c in ("node", "uuid") else tel.column(c)
                    for c in tel.column_names})
    t = tel.column("timestamp").cast(pa.int64()).to_numpy()
    nodes, gpus, uuids = (tel.column(c).to_pylist() for c in ("node", "gpu", "uuid"))
    xids = pq.read_table(trace / "xid.parquet").to_pydict()
    x_t = pa.array(xids["timestamp"], pa.timestamp("ms", tz="UTC")).cast(pa.int64()).to_pylist()
    keys = sorted(set(zip(nodes, gpus, uuids)))
    rows_of = {k: [] for k in keys}
    for i, k in enumerate(zip(nodes, gpus, uuids)):
        rows_of[k].append(i)

    def labels(node: str, gpu: int, uuid: str | None) -> str:
        return (f'{dcgm.GPU_LABEL}="{gpu}",{dcgm.UUID_LABEL}="{uuid or ""}",device="nvidia{gpu}",'
                f'{dcgm.MODEL_LABEL}="NVIDIA H100 80GB HBM3",{dcgm.NODE_LABEL}="{node}",job="dcgm"')

    with open(out, "w") as f:
        for m in METRICS:                 # counters as gauges: OpenMetrics counters need a _total name
            f.write(f"# TYPE {m} gauge\n")
            v = tel.column(m).cast(pa.float64()).to_numpy(zero_copy_only=False)
            for k in keys:
                lab = labels(*k)
                for i in rows_of[k]:
                    if not np.isnan(v[i]):
                        f.write(f"{m}{{{lab}}} {float(v[i])!r} {_sec(int(t[i]))}\n")
        f.write(f"# TYPE {XID_ERRORS} gauge\n")
        for k in keys:
            node, gpu, _ = k
            events = sorted((te, code) for te, n, g, code in zip(x_t, xids["node"], xids["gpu"], xids["xid"])
                            if n == node and g == gpu)
            times = sorted(set(int(t[i]) for i in rows_of[k]) | {te for te, _ in events})
            j, last = 0, 0
            for ts in times:
                while j < len(events) and events[j][0] <= ts:
                    last = events[j][1]
                    j += 1
                f.write(f"{XID_ERRORS}{{{labels(*k)}}} {last} {_sec(ts)}\n")
        f.write("# EOF\n")


def xids_as_gauge_shows(trace: Path, out: Path) -> None:
    """`trace` with the XIDs a last-value gauge can show: a repeat of the GPU's previous code is lost."""
    shutil.copytree(trace, out)
    x = pq.read_table(trace / "xid.parquet").sort_by([("timestamp", "ascending")])
    keep, last = [], {}
    for node, gpu, code in zip(*(x.column(c).to_pylist() for c in ("node", "gpu", "xid"))):
        keep.append(last.get((node, gpu)) != code)
        last[(node, gpu)] = code
    pq.write_table(x.filter(pa.array(keep)), out / "xid.parquet")


class Prometheus:
    """`prometheus` on 127.0.0.1 serving a backfilled TSDB; `web_config` for basic auth."""

    def __init__(self, tmp: Path, storage: Path, web_config: Path | None = None):
        cfg = tmp / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1h\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(tmp / "prometheus.log", "w+")
        args = [need("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={storage}",
                "--storage.tsdb.retention.time=100y", f"--web.listen-address=127.0.0.1:{self.port}"]
        if web_config is not None:
            args.append(f"--web.config.file={web_config}")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        auth = ("reader", "s3cret-pass") if web_config is not None else None
        try:
            ready = wait_for(lambda: self._ready(auth), timeout=60)
        except BaseException:
            self.stop()                   # never leave it running, whatever went wrong
            raise
        if not ready:
            self.stop()
            raise AssertionError(f"prometheus did not become ready: {self.output()}")

    def _ready(self, auth) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.output()}")
        try:
            return requests.get(self.url + "/-/ready", auth=auth, timeout=1).ok
        except requests.RequestException:
            return False

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def backfill(trace: Path, storage: Path) -> None:
    om = storage.parent / "trace.om"
    write_openmetrics(trace, om)
    res = subprocess.run([need("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(om), str(storage)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def basic_auth_config(path: Path) -> Path:
    """A --web.config.file letting user `reader` in with password `s3cret-pass`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # bcrypt through the system's libxcrypt (no extra package); cost 4
        hashed = crypt.crypt("s3cret-pass", crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    path.write_text(f"basic_auth_users:\n  reader: '{hashed}'\n")
    return path


class FakePrometheus:
    """A careless or hostile Prometheus on 127.0.0.1: ``answers[path]`` is the body for that API
    path (bytes, or a callable giving the pieces of a body too large to hold); ``drip_s``
    sleeps between 256-byte pieces."""

    def __init__(self, answers: dict[str, bytes | Callable[[], Iterable[bytes]]]):
        self.answers, self.drip_s = answers, 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                answer = fake.answers.get(self.path.split("?")[0], b'{"status":"error","error":"no such path"}')
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                write_dripping(self.wfile, answer() if callable(answer) else [answer], fake.drip_s)

        self._http = LoopbackHTTP(Handler)
        self.url = self._http.base_url

    def stop(self) -> None:
        self._http.stop()
