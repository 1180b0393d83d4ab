"""``ckpt simulate``: a spare staged at the predictor's alarm. A node taken out of the job
waits ``--replace-s`` for its replacement; when the predictor caught the failure, the
spare was requested at the alarm and the wait left after the failure is
max(0, replace_s − lead). Only (c)–(e) have a predictor; ``--no-spare-on-alarm`` turns
it off."""
from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from ckpt.goodput import inputs
from ckpt.goodput.model import MIN_LEAD_S, Lead, analytic
from ckpt.goodput.restart import RestartCosts
from tests.test_simulate import DEFAULT_RUN, defaults, run_cli


def test_the_wait_left_is_what_the_lead_did_not_cover() -> None:
    lead = Lead(median_s=1800.0, p10_s=300.0)
    assert lead.shortfall(0.0) == lead.shortfall(MIN_LEAD_S) == 0.0  # every caught failure has 2 min of lead
    rng = random.Random(7)
    draws = [lead.sample(rng, 0.0) for _ in range(20000)]
    for wait in (300.0, 900.0, 3000.0):
        sampled = sum(max(0.0, wait - d) for d in draws) / len(draws)
        assert lead.shortfall(wait) == pytest.approx(sampled, rel=0.03)
    assert lead.shortfall(7200.0) == pytest.approx(7200.0 - sum(draws) / len(draws), rel=0.01)


def test_only_strategies_with_a_predictor_stage_the_spare() -> None:
    costs = RestartCosts(replace_s=600.0)
    staged, plain = defaults(costs), defaults(replace(costs, spare_on_alarm=False))
    caught = DEFAULT_RUN.precursor_share * inputs.PREDICTOR["node"]["recall_of_predictable"]
    lead = staged[2].skill.lead
    for s, p in zip(staged, plain):
        assert s.crash == p.crash and p.gpu.replace_s == p.host.replace_s == 600.0
        expected = 600.0 if s.skill is None else (1 - caught) * 600.0 + caught * lead.shortfall(600.0)
        assert s.gpu.replace_s == s.host.replace_s == pytest.approx(expected)
        assert replace(s.gpu, replace_s=600.0) == p.gpu
        if s.skill is not None:
            assert analytic(DEFAULT_RUN, s).waste < analytic(DEFAULT_RUN, p).waste
    assert [s.name for s in staged if s.skill is not None] == ["c", "d", "e"]
    # a spare that takes no longer than the shortest lead a catch has is there for every caught failure
    e = defaults(RestartCosts(replace_s=MIN_LEAD_S))[4]
    assert e.gpu.replace_s == pytest.approx((1 - caught) * MIN_LEAD_S)
    # a hot spare already in the rendezvous: nothing to stage
    assert all(s.gpu.replace_s == s.host.replace_s == 0.0 for s in defaults(RestartCosts(replace_s=0.0)))


def test_cli_turns_it_off_and_says_so() -> None:
    on = json.loads(run_cli("--json", "--objstore-gbps", "1")[1])
    code, out = run_cli("--json", "--objstore-gbps", "1", "--no-spare-on-alarm")
    off = json.loads(out)
    assert code == 0 and on["restart"]["spare_on_alarm"] and not off["restart"]["spare_on_alarm"]
    waste = {d["strategy"]: (o["waste"], d["waste"]) for o, d in zip(on["analytic"], off["analytic"])}
    assert waste["a"][0] == waste["a"][1] and waste["b"][0] == waste["b"][1]
    assert all(waste[k][0] < waste[k][1] for k in "cde")
    assert off["restart_phases"]["e"]["seconds"]["host"]["replace"] == 120.0
    code, text = run_cli("--objstore-gbps", "1")
    assert code == 0 and "spare 120 s, staged at alarms" in text
