"""deploy/agents: the scrape config and alert rules pass Prometheus' own checks and unit tests."""
import os
import shutil
import subprocess

import pytest

DEPLOY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "agents")

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian package prometheus not installed")


@pytest.mark.parametrize("args", [["check", "config", "prometheus-scrape.yml"], ["check", "rules", "alerts.yml"],
                                  ["test", "rules", "alerts_test.yml"]])
def test_promtool_accepts(args):
    res = subprocess.run(["promtool", *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
