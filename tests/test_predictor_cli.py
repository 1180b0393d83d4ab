"""The predictor's and agents' command lines: -h everywhere, help that matches the code, one env prefix."""
import json
import warnings

import click
import pytest
from click.testing import CliRunner

from agents.cli import main as agents_main
from predictor.cli import main as predictor_main
from predictor.ingest import auth
from predictor.serve.server import ROUTE_ROLES
from tests.predictor_fixtures import run_cli


def _commands(group: click.Group) -> list[list[str]]:
    return [[]] + [[name] for name in group.commands]


@pytest.mark.parametrize("group", [predictor_main, agents_main], ids=["predictor", "agents"])
def test_dash_h_is_help_for_every_command(group):
    for args in _commands(group):
        res = CliRunner().invoke(group, [*args, "-h"])
        assert res.exit_code == 0 and res.output.startswith("Usage:"), (args, res.output)


def test_serve_help_names_the_roles_the_server_knows():
    roles = set().union(*ROUTE_ROLES.values())
    assert roles == set(auth.ROLES)
    text = " ".join(CliRunner().invoke(predictor_main, ["serve", "-h"]).output.split())
    assert "|".join(auth.ROLES) in text and "admin" not in text


def test_tokens_come_from_the_projects_env_prefix(monkeypatch):
    for var in [*auth.ENV_TOKENS.values(), auth.ENV_FILE]:
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.replace("CKPT_GUARD_", "PREDICTOR_"), raising=False)
    monkeypatch.setenv("CKPT_GUARD_AGENT_TOKEN", "agent-token-0123456789")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert auth.load_tokens().role_of("Bearer agent-token-0123456789") == "agent"
    monkeypatch.setenv("PREDICTOR_JOB_TOKEN", "job-token-0123456789ab")
    with pytest.warns(FutureWarning, match=r"\$PREDICTOR_JOB_TOKEN is deprecated: set \$CKPT_GUARD_JOB_TOKEN"):
        tokens = auth.load_tokens()
    assert tokens.role_of("Bearer job-token-0123456789ab") == "job"


def test_with_json_an_error_is_json_with_its_exit_code(tmp_path):
    """A script that asked for --json parses the failure too: a usage error (2), a file in the
    way (1, one line: no traceback)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for module, args, code, says in (
            ("predictor.cli", ("eval", "--trace", str(tmp_path / "typo")), 2, "does not exist"),
            ("agents.cli", ("simulate", "--nodes", "1", "--days", "0.01", "--out", str(a_file / "t")), 1,
             "Not a directory")):
        res = run_cli(module, *args, "--json", check=False)
        assert res.returncode == code and "Traceback" not in res.stderr, (module, res.stdout, res.stderr)
        out = json.loads(res.stdout)
        assert out["exit_code"] == code and says in out["error"], (module, out)
        plain = run_cli(module, *args, check=False)
        assert plain.returncode == code and says in plain.stderr and "Traceback" not in plain.stderr, plain.stderr
