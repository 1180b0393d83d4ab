"""`agents run --source dcgm-exporter` (issue 20.1): pages in dcgm-exporter's text format,
served on loopback, mapped onto SCHEMA.md; XID changes, stale XIDs, missing fields and
vanished GPUs; then end to end into a real `predictor serve`."""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import requests

from agents.sources.dcgm_exporter import DcgmExporterSource, ScrapeError, fetch
from telemetry import dcgm as D
from telemetry import schema as S
from tests.dcgm_fixtures import MODEL, FakeExporter, gpu, render
from tests.predictor_fixtures import ROOT, TOKENS
from tests.procs import HTTP_S, drip_to, stop_process, wait_for


@pytest.fixture
def exporter() -> Iterator[FakeExporter]:
    srv = FakeExporter()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def source(exporter) -> Iterator[DcgmExporterSource]:
    src = DcgmExporterSource([exporter.url], timeout_s=2.0)
    try:
        yield src
    finally:
        src.close()


def by_gpu(rows: list[dict]) -> dict[int, dict]:
    return {r["gpu"]: r for r in rows}


def test_default_fields_map_onto_the_schema_and_the_rest_is_reported_once(exporter, source, caplog) -> None:
    exporter.page = render("dgx-a", [gpu(0), gpu(1)])
    with caplog.at_level(logging.WARNING, logger="agents.sources.dcgm_exporter"):
        rows = by_gpu(source.read())
        source.read()
    assert set(rows) == {0, 1}
    r = rows[1]
    assert r["node"] == "dgx-a" and r["uuid"] == gpu(1).uuid and source.model_name("dgx-a", 1) == MODEL
    assert (r[S.GPU_TEMP], r[S.MEMORY_TEMP], r[S.POWER], r[S.SM_CLOCK]) == (39.0, 46.0, 613.5, 1980.0)
    assert (r[S.PCIE_REPLAY], r[S.REMAP_CORR], r[S.REMAP_UNCORR], r[S.REMAP_FAILURE]) == (1.0, 2.0, 0.0, 0.0)
    assert all(r[m] is None for m in D.NOT_IN_DEFAULT)  # blank, as SCHEMA.md has unsupported fields
    missing = [rec.getMessage() for rec in caplog.records if "does not serve" in rec.getMessage()]
    assert len(missing) == 1 and all(m in missing[0] for m in D.NOT_IN_DEFAULT)  # once, not per scrape
    fam = {f.name: f for f in source.metrics()}["ckpt_guard_agent_dcgm_field_missing"]
    assert sorted(s.labels["field"] for s in fam.samples) == sorted(D.NOT_IN_DEFAULT)

    exporter.page = render("dgx-a", [gpu(0), gpu(1)], extra_fields=True)  # the operator enabled them
    r = by_gpu(source.read())[0]
    assert (r[S.SBE], r[S.DBE], r[S.NVLINK_CRC], r[S.THROTTLE]) == (10.0, 0.0, 3.0, 4.0)  # clocks-event alias
    assert not {f.name: f for f in source.metrics()}["ckpt_guard_agent_dcgm_field_missing"].samples


def test_last_xid_gauge_a_stale_value_is_no_event_a_change_is(exporter, source) -> None:
    g0, g1 = gpu(0), gpu(1)
    g1.last_xid = 79                       # logged before the agent started: history
    exporter.page = render("dgx-a", [g0, g1])
    source.read()
    assert source.xids() == []
    source.read()
    assert source.xids() == []             # still the same value: nothing new
    g0.last_xid = 13
    exporter.page = render("dgx-a", [g0, g1])
    source.read()
    events = source.xids()
    assert [(e["node"], e["gpu"], e["xid"]) for e in events] == [("dgx-a", 0, 13)]
    g0.last_xid = 48
    exporter.page = render("dgx-a", [g0, g1])
    rows = source.read()
    assert [(e["gpu"], e["xid"], e["timestamp"]) for e in source.xids()] == [(0, 48, rows[0]["timestamp"])]


def test_xid_counter_series_gives_every_event_and_wins_over_the_gauge(exporter, source) -> None:
    g0, g1 = gpu(0), gpu(1)
    g1.xid_totals, g1.last_xid = {31: 4}, 31
    exporter.page = render("dgx-a", [g0, g1], xid_totals=True)
    source.read()
    assert source.xids() == []             # four XID 31 before the agent started
    g1.xid_totals = {31: 6, 79: 1}         # two more 31s (the gauge cannot tell) and a first 79
    g1.last_xid = 79
    exporter.page = render("dgx-a", [g0, g1], xid_totals=True)
    source.read()
    assert sorted((e["gpu"], e["xid"]) for e in source.xids()) == [(1, 31), (1, 31), (1, 79)]
    g1.xid_totals = {31: 1, 79: 1}         # the exporter restarted: counts from zero again
    exporter.page = render("dgx-a", [g0, g1], xid_totals=True)
    source.read()
    assert [(e["gpu"], e["xid"]) for e in source.xids()] == [(1, 31)]


def test_a_gpu_that_leaves_the_page_is_reported(exporter, source, caplog) -> None:
    gpus = [gpu(i) for i in range(4)]
    exporter.page = render("dgx-a", gpus)
    assert len(source.read()) == 4
    exporter.page = render("dgx-a", gpus[:2] + gpus[3:])
    with caplog.at_level(logging.WARNING, logger="agents.sources.dcgm_exporter"):
        assert sorted(by_gpu(source.read())) == [0, 1, 3]
    assert source.gpus_vanished == 1
    assert any("GPU 2 of dgx-a is no longer on the page" in r.getMessage() for r in caplog.records)
    fam = {f.name: f for f in source.metrics()}["ckpt_guard_agent_dcgm_gpus_vanished"]
    assert fam.samples[0].value == 1
    source.read()
    assert source.gpus_vanished == 1       # reported once, not every scrape


def test_failed_scrapes_are_counted_and_leave_the_other_exporters(exporter, caplog) -> None:
    other = FakeExporter(render("dgx-b", [gpu(0, "b")]))
    src = DcgmExporterSource([exporter.url, other.url], timeout_s=0.5, max_bytes=64 << 10)
    try:
        for page, status, delay, drip in (("", 500, 0, 0), ("# TYPE x gauge\nx{gpu=\"0\" 1\n", 200, 0, 0),
                                          (render("dgx-a", [gpu(i) for i in range(8)]) * 20, 200, 0, 0),
                                          (render("dgx-a", [gpu(0)]), 200, 1.5, 0),   # no answer in time
                                          (render("dgx-a", [gpu(0)]), 200, 0, 0.1)):  # bytes dripping
            exporter.page, exporter.status, exporter.delay_s, exporter.drip_s = page, status, delay, drip
            rows = src.read()
            assert [(r["node"], r["gpu"]) for r in rows] == [("dgx-b", 0)]
        assert src.scrape_errors == 5
        up = {f.name: f for f in src.metrics()}["ckpt_guard_agent_dcgm_up"]
        assert {s.labels["url"]: s.value for s in up.samples} == {exporter.url: 0.0, other.url: 1.0}
        exporter.page, exporter.status, exporter.delay_s, exporter.drip_s = render("dgx-a", [gpu(0)]), 200, 0, 0
        assert sorted(r["node"] for r in src.read()) == ["dgx-a", "dgx-b"]
        up = {f.name: f for f in src.metrics()}["ckpt_guard_agent_dcgm_up"]
        assert {s.labels["url"]: s.value for s in up.samples} == {exporter.url: 1.0, other.url: 1.0}
    finally:
        src.close()
        other.stop()


def test_bad_urls_are_usage_errors(tmp_path) -> None:
    res = subprocess.run([sys.executable, "-m", "agents.cli", "run", "--source", "dcgm-exporter", "--metrics-port",
                          "0", "--dcgm-url", "gpu-node:9400/metrics", "--spool-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "http(s)://host:port/metrics" in res.stderr
    res = subprocess.run([sys.executable, "-m", "agents.cli", "run", "--source", "dcgm-exporter", "--metrics-port",
                          "0", "--spool-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--dcgm-url" in res.stderr


def _risk(srv, node: str) -> dict | None:
    r = requests.get(f"{srv.url}/v1/risk", params={"node": node}, headers=srv.headers("operator"), timeout=HTTP_S)
    return r.json() if r.status_code == 200 else None


def test_agent_streams_an_exporter_to_the_predictor_and_its_xid_holds_the_gpu(exporter, live_server,
                                                                              tmp_path) -> None:
    srv = live_server()
    token = tmp_path / "agent.token"
    token.write_text(TOKENS["agent"])
    g = [gpu(i) for i in range(2)]
    g[1].last_xid = 79                                     # stale: must not flag GPU 1 at start-up
    exporter.page = render("dgx-a", g)
    agent = subprocess.Popen([sys.executable, "-m", "agents.cli", "run", "--source", "dcgm-exporter",
                              "--dcgm-url", exporter.url, "--predictor", srv.url, "--token-file", str(token),
                              "--interval", "0.3", "--batch-seconds", "0.3", "--metrics-port", "0",
                              "--spool-dir", str(tmp_path / "spool")], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        scored = wait_for(lambda: (r := _risk(srv, "dgx-a")) and len(r["gpus"]) == 2
                          and all(x["at_ms"] > 0 for x in r["gpus"]) and r, timeout=60)
        assert scored, srv.output()[-2000:]
        assert all(x["risk"] < 1 for x in scored["gpus"]), scored
        g[0].last_xid = 79                                 # a new critical XID on GPU 0
        exporter.page = render("dgx-a", g)
        held = wait_for(lambda: (r := _risk(srv, "dgx-a")) and r["gpus"][0]["reason"] == "critical XID 79" and r,
                        timeout=60)
        assert held, srv.output()[-2000:]
        assert held["gpus"][1]["risk"] < 1
    finally:
        stop_process(agent)
        err = agent.stderr.read()
    assert "does not serve" in err and "DCGM_FI_DEV_XID_ERRORS" in err, err


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "1e300"])
def test_a_bad_xid_reading_on_one_page_is_dropped_and_the_other_exporters_flow(exporter, bad, caplog) -> None:
    """Issue 32.4: one page's NaN/Inf last-XID gauge made every read raise."""
    other = FakeExporter()
    src = DcgmExporterSource([exporter.url, other.url], timeout_s=2.0)
    try:
        a, b = gpu(0), gpu(0, "b")
        exporter.page, other.page = render("dgx-a", [a]), render("dgx-b", [b])
        src.read()
        exporter.page = "\n".join(line.rsplit(" ", 1)[0] + f" {bad}" if line.startswith(S.XID_ERRORS + "{") else line
                                   for line in render("dgx-a", [a]).splitlines()) + "\n"
        assert exporter.page.count(f" {bad}\n") == 1
        b.last_xid = 79
        other.page = render("dgx-b", [b])
        with caplog.at_level(logging.WARNING, logger="agents.sources.dcgm_exporter"):
            rows = src.read()
            src.read()
        assert sorted((r["node"], r["gpu"]) for r in rows) == [("dgx-a", 0), ("dgx-b", 0)]
        assert [(e["node"], e["xid"]) for e in src.xids()] == [("dgx-b", 79)]
        dropped = {f.name: f for f in src.metrics()}["ckpt_guard_agent_dcgm_series_dropped"]
        assert {s.labels["reason"]: s.value for s in dropped.samples} == {"bad XID reading": 2}
        said = [r.getMessage() for r in caplog.records if "bad XID reading" in r.getMessage()]
        assert len(said) == 1 and exporter.url in said[0]             # logged once, not every scrape
    finally:
        src.close()
        other.stop()


def test_a_bad_metric_value_is_blank_and_counted(exporter, source) -> None:
    exporter.page = render("dgx-a", [gpu(0, **{S.GPU_TEMP: float("inf")}), gpu(1)])
    rows = by_gpu(source.read())
    assert rows[0][S.GPU_TEMP] is None and rows[0][S.POWER] == 612.5 and rows[1][S.GPU_TEMP] == 39.0
    dropped = {f.name: f for f in source.metrics()}["ckpt_guard_agent_dcgm_series_dropped"]
    assert {s.labels["reason"]: s.value for s in dropped.samples} == {"non-finite value": 1}


@pytest.mark.parametrize("index", [64, 40000, -1])
def test_an_out_of_range_gpu_index_drops_that_gpu_only(exporter, index) -> None:
    """Issue 32.4: gpu="40000" failed the Arrow conversion of every buffered batch (int16);
    past the predictor's 64 GPUs per node it made the predictor refuse the whole batch."""
    other = FakeExporter(render("dgx-b", [gpu(0, "b")]))
    src = DcgmExporterSource([exporter.url, other.url], timeout_s=2.0)
    try:
        bad = gpu(index)
        exporter.page = render("dgx-a", [gpu(0), bad])
        rows = src.read()
        assert sorted((r["node"], r["gpu"]) for r in rows) == [("dgx-a", 0), ("dgx-b", 0)]
        dropped = {f.name: f for f in src.metrics()}["ckpt_guard_agent_dcgm_series_dropped"]
        mapped = [name for line in exporter.page.splitlines() if f'gpu="{index}"' in line
                  and ((name := line.split("{")[0]) in D.XID_SERIES or D.column_for(name))]
        assert {s.labels["reason"]: s.value for s in dropped.samples} == {"gpu index out of range": len(mapped)}
    finally:
        src.close()
        other.stop()


def test_a_server_dripping_its_headers_is_cut_at_the_timeout() -> None:
    """A byte of header every 100 ms never trips a per-read timeout; the scrape's limit is in all."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            head = b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 600
            drip_to(conn, (head[i:i + 1] for i in range(len(head))), 0.1, stop)
    server = threading.Thread(target=drip, daemon=True)
    server.start()
    started = time.monotonic()
    try:
        with pytest.raises(ScrapeError, match="not read within 1 s"):
            fetch(f"http://127.0.0.1:{listener.getsockname()[1]}/metrics", timeout_s=1.0)
        assert time.monotonic() - started < 10    # generous: not the minute the drip would take
    finally:
        stop.set()
        server.join(timeout=10)
        listener.close()
