"""Quarantine (ckpt/quarantine.py): a node blamed for N restarts within a window is kept
out of the job's later restarts; an operator lists, checks and clears it. The torchrun
test gives node "nodeq" two strikes on record and hangs one of its ranks: the restart
adds the third, every rank logs the quarantine and the job stops with code 88."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from ckpt.quarantine import EXIT_QUARANTINED
from ckpt.recovery import quarantine
from tests.integration_helpers import REPO, torchrun


def strike(t: float, restart: str, cause: str = "hang") -> dict:
    return {"t": t, "cause": cause, "restart": restart}


def test_strikes_within_the_window_quarantine_a_node(tmp_path: Path) -> None:
    path = tmp_path / "quarantine-r.json"
    quarantine.write(path, {"a": [strike(100, "i1")], "b": [strike(100, "i1")]})
    quarantine.write(path, {"a": [strike(200, "i2"), strike(100, "i1")]})  # i1 again: no second strike
    merged = quarantine.merge([quarantine.read(path)], {"a": strike(300, "i3")})
    assert [s["restart"] for s in merged["a"]] == ["i1", "i2", "i3"]
    assert quarantine.quarantined(merged, limit=3, window_s=1000, now=400) == {"a": merged["a"]}
    assert quarantine.quarantined(merged, limit=3, window_s=250, now=400) == {}  # i1 is too old
    assert quarantine.quarantined(merged, limit=0, window_s=1000, now=400) == {}  # off


def test_operator_checks_and_clears_a_node(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "quarantine-r.json"
    quarantine.write(path, {"a": [strike(time.time() - i, f"i{i}") for i in range(3)]})
    assert quarantine.main(["check", "--record", str(path), "--node", "a"]) == EXIT_QUARANTINED
    assert quarantine.main(["check", "--record", str(path), "--node", "b"]) == 0
    capsys.readouterr()
    assert quarantine.main(["list", "--record", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quarantined"] == ["a"]
    assert quarantine.main(["clear", "--record", str(path), "--node", "a"]) == 0
    assert quarantine.main(["check", "--record", str(path), "--node", "a"]) == 0
    with pytest.raises(SystemExit):
        quarantine.main(["clear", "--record", str(path)])  # which node?


@pytest.mark.parametrize("raw", [b'{"strikes": []}', b"null", b"[1, 2]", b"[" * 100_000, b"\xff\xfe not utf-8",
                                 b'{"strikes": {"a": [null, {"t": "x"}, 3], "b": 7}}'],
                         ids=["strikes-a-list", "null", "a-list", "100k-deep", "not-utf8", "bad-strikes"])
def test_a_record_of_the_wrong_shape_is_ignored_with_one_line(tmp_path: Path, raw: bytes,
                                                            caplog: pytest.LogCaptureFixture,
                                                            capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "quarantine-r.json"
    path.write_bytes(raw)
    assert quarantine.read(path) == {}
    assert "quarantine record" in caplog.text
    assert quarantine.main(["list", "--record", str(path)]) == 0
    assert quarantine.main(["check", "--record", str(path), "--node", "a"]) == 0
    quarantine.write(path, {"c": [strike(time.time(), "i1")]})  # the next strike replaces the damage
    assert list(quarantine.read(path)) == ["c"]


def test_good_strikes_beside_bad_ones_still_count(tmp_path: Path) -> None:
    path = tmp_path / "quarantine-r.json"
    now = time.time()
    path.write_text(json.dumps({"strikes": {"a": [strike(now - i, f"i{i}") for i in range(3)] + [{"t": None}],
                                            "b": "garbage"}}))
    assert quarantine.quarantined(quarantine.read(path), limit=3, window_s=60).keys() == {"a"}


def test_strikes_stamped_in_the_future_do_not_count(tmp_path: Path) -> None:
    now = time.time()
    strikes = {"a": [strike(now + 1e9 + i, f"i{i}") for i in range(3)], "b": [strike(now + 5 + i, f"j{i}")
                                                                              for i in range(3)]}
    assert quarantine.quarantined(strikes, limit=3, window_s=3600, now=now).keys() == {"b"}  # b: clock skew


def test_a_node_hung_a_third_time_is_quarantined(tmp_path: Path, shm_dir: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_GUARD_NODE", "nodeq")
    root = tmp_path / "root"
    root.mkdir()
    run = "none"  # torchrun's run id when it is given none: the example's default run
    now = time.time()  # two strikes in the last minutes: the hang below adds the third within the hour
    strikes = {"nodeq": [strike(now - 120, "old1"), strike(now - 60, "old2")]}
    quarantine.write(quarantine.record_path(root, run), strikes)
    log = torchrun(REPO / "examples" / "train_torchrun.py", "--root", str(root), "--steps", "30",
                   "--every", "5", "--memory-dir", shm_dir, "--faults", "12:stop", "--hang-deadline", "3",
                   restarts=1, check=False)
    assert "hang detected" in log, log[-4000:]
    for rank in (0, 1):
        assert re.search(rf"rank{rank} node nodeq is quarantined \(3 strikes within 3600 s\).*python -m "
                         rf"ckpt.quarantine clear --record \S+quarantine-none.json --node nodeq`; exiting with code 88",
                         log), log[-4000:]
    assert f"exitcode: {EXIT_QUARANTINED}" in log or "SIGTERM" in log, log[-4000:]
    assert "incarnation 1: first step" not in log, "the quarantined node trained on"
    held = quarantine.read(quarantine.record_path(root, run))["nodeq"]
    assert len(held) == 3 and any(s["cause"].startswith("hang: frozen") for s in held), held
