"""The telemetry contract is defined once (telemetry/) and both sides use it."""
import gzip
import re
from pathlib import Path

import pytest

from telemetry import schema as S
from telemetry.wire import Corrupt, OverCap, inflate

ROOT = Path(__file__).resolve().parents[1]


def test_dcgm_names_and_xid_classes_are_written_only_in_the_contract():
    """A second list of field names or XID codes would drift from SCHEMA.md unnoticed."""
    xid_set = re.compile(r"frozenset\(\{\s*(?:13|48|63)\b")
    for path in [*ROOT.glob("agents/**/*.py"), *ROOT.glob("predictor/**/*.py")]:
        text = path.read_text()
        assert '"DCGM_FI_' not in text, f"{path.relative_to(ROOT)} spells a DCGM field name"
        assert not xid_set.search(text), f"{path.relative_to(ROOT)} lists XID codes"
        assert "decompressobj" not in text, f"{path.relative_to(ROOT)} inflates gzip itself"


def test_xid_classes_are_disjoint():
    assert not (S.CRITICAL_XIDS & S.WARNING_XIDS) and not (S.CRITICAL_XIDS & S.APPLICATION_XIDS)
    assert S.is_critical_xid(79) and not S.is_critical_xid(13)


def test_inflate_caps_and_refuses_truncated_bodies():
    body = gzip.compress(b"x" * 1000)
    assert inflate(body, 1000) == b"x" * 1000
    with pytest.raises(OverCap):
        inflate(body, 999)
    with pytest.raises(Corrupt, match="truncated"):
        inflate(body[: len(body) // 2], 1000)
    with pytest.raises(Corrupt, match="does not decompress"):
        inflate(b"\x1f\x8b" + b"junk" * 10, 1000)
