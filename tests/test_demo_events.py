"""The demo prints its story's events live, each once, as the job logs them."""
from __future__ import annotations

from pathlib import Path

from examples.demo import Run, collect_alarm


def test_alarm_and_urgent_save_are_reported_once_as_they_appear(tmp_path: Path) -> None:
    run = Run("with-predictor", tmp_path)
    log = tmp_path / "train.log"
    log.write_text("2026-11-23 10:00:01,250 rank0 training from step 0\n")
    assert collect_alarm(run) == []
    with log.open("a") as f:
        f.write("2026-11-23 10:01:10,700 rank0 predictor: node n1 at risk (PCIe replay ramp); requested an urgent "
                "checkpoint\n")
    assert [e for e, _ in collect_alarm(run)] == ["alarm"]
    with log.open("a") as f:
        f.write("2026-11-23 10:01:10,900 rank0 urgent checkpoint of step 123 durable in every tier 0.18 s after "
                "save() (disk 0.05 s, object 0.18 s)\n")
    (event, text), = collect_alarm(run)
    assert event == "urgent_durable" and "step 123" in text and run.events["urgent_step"] == 123
    assert collect_alarm(run) == []
    assert abs(run.events["urgent_durable"] - run.events["alarm"] - 0.2) < 1e-6
