"""The fault campaign (benchmarks/fault_campaign.py) as tests: by default the rows no other test
covers (a second fault during a recovery, NaN from a forward, a peer replica sealed wrong); with ``-m extended``
also a killed rank, a flipped parameter bit (on one node and on two), a vanished node, a peer
holder killed and an unreachable object store; the whole campaign with ``-m campaign``. Real
launchers and gloo ranks, a moto server; bounds are hang guards only.

What is asserted is what every row must hold whatever the checks see: a fault that was
recovered from ends bitwise equal to the clean run, and an SDC row never claims more than
happened (an undetected flipped parameter leaves the replicas apart; a flipped gradient bit
leaves them equal)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ckpt_helpers import REPO

FAULT_AT = 4  # benchmarks/fault_campaign_jobs.py: the step in which every fault happens

# disk_shard_damaged is left to -m campaign: its job's only sealed step on disk is the damaged one,
# so the restore refuses it (loudly, nothing wrong restored) and the row ends as an error, not a recovery
# killed_rank and sdc_param_bit are what tests/test_inprocess.py and tests/test_sound_state.py run:
# the default suite keeps the rows none of them covers (a second fault during a recovery, NaN from
# one rank's forward gone back from in process, a peer replica sealed wrong), -m extended the others
CHEAP = [pytest.param(["second_fault_in_recovery", "sdc_nan_forward"], id="second-fault-and-nan"),
         pytest.param(["peer_replica_wrong_at_save"], id="peer-replica-wrong"),
         pytest.param(["killed_rank", "sdc_param_bit"], id="covered-elsewhere", marks=pytest.mark.extended),
         pytest.param(["vanished_node", "peer_holder_killed"], id="nodes", marks=pytest.mark.extended),
         pytest.param(["objstore_unreachable"], id="objstore", marks=pytest.mark.extended),
         pytest.param(["sdc_param_bit_2_nodes"], id="sdc-2-nodes", marks=pytest.mark.extended),
         pytest.param(["canary_fail_inprocess"], id="canary", marks=pytest.mark.extended)]
# the faults the job must survive ending bitwise equal to the clean run
SURVIVED = {"killed_rank", "hung_rank", "lost_node", "vanished_node", "xid79", "second_fault_in_recovery",
            "launcher_killed", "memory_slot_damaged", "disk_shard_damaged", "straggler", "predictor_agent_down",
            "local_disk_full", "peer_replica_wrong_at_save", "peer_holder_killed", "objstore_unreachable"}
KEYS = {"fault", "mode", "detected", "detect_steps", "named", "restored_step", "steps_lost", "relaunched",
        "equal_to_clean"}


def campaign(tmp_path: Path, faults: list[str] | None, timeout: float) -> dict:
    out = tmp_path / "campaign.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "fault_campaign.py"), "--json", str(out),
           *(["--faults", ",".join(faults)] if faults else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


def check(rows: list[dict]) -> None:
    for r in rows:
        assert "error" not in r, r
        if "skipped" in r:
            assert r["skipped"], r
            continue
        assert KEYS <= set(r), r
        assert r["mode"] in ("in-process", "relaunch"), r
        if r["fault"] in SURVIVED:
            assert r["equal_to_clean"], r
        # slow, unadvised or without disk room is not dead: nothing redone
        if r["fault"] in ("straggler", "predictor_agent_down", "local_disk_full", "objstore_unreachable"):
            assert r["restored_step"] is None and not r["relaunched"], r
        elif r["fault"] in SURVIVED:
            assert r["detected"] and r["restored_step"] is not None, r
        if r["fault"] in ("sdc_param_bit", "sdc_optim_bit") and not r["detected"]:
            assert not r["replicas_equal_at_end"], r  # the fault happened, and nothing saw it
        if r["fault"] == "peer_replica_wrong_at_save":  # refused by its checksums, an older copy taken
            assert r["damaged_step"] is not None and r["restored_step"] < r["damaged_step"], r
        if r["fault"] == "objstore_unreachable":  # trained through the outage; the store alone restores the end
            assert r["steps_during_outage"] >= 1 and r["retries"] >= 1, r
            assert r["fresh_node_from_object_store"] and r["fresh_node_equal_to_clean"], r
        if r["fault"].endswith("_2_nodes"):  # two replicas, one a node: caught, both named, gone back before it
            assert r["detected"] and r["named"] and r["equal_to_clean"] and r["restored_step"] <= FAULT_AT, r
        if r["fault"] == "sdc_grad_bit":
            assert r["replicas_equal_at_end"], r  # averaged into every gradient: no replica to compare
        if r["fault"] == "sdc_nan_forward" and not r["detected"]:
            assert not r["finite_at_end"], r
        if r["fault"] == "canary_fail_inprocess":  # gone back in process before the step it failed from
            assert r["detected"] and r["restored_step"] < r["resumed_at"], r
        if (r["fault"].startswith("sdc_") and r["detected"]) or r["fault"] == "canary_fail_inprocess":
            assert r["mode"] == "in-process" and not r["relaunched"] and r["equal_to_clean"], r


@pytest.mark.parametrize("rows", CHEAP)
@pytest.mark.timeout(3000)
def test_cheap_subset_of_the_campaign(tmp_path: Path, rows: list[str]) -> None:
    found = campaign(tmp_path, rows, 2900)
    assert [r["fault"] for r in found["rows"]] == rows
    assert found["meta"]["steps"] > found["meta"]["fault_at"]
    check(found["rows"])


@pytest.mark.campaign
@pytest.mark.timeout(7200)
def test_the_whole_campaign(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "campaign" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the whole fault campaign runs with -m campaign (about 15 minutes on 2 idle cores)")
    check(campaign(tmp_path, None, 7000)["rows"])
