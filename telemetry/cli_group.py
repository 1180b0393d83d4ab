"""The click group of a role's command (`agents`, `predictor`): how its errors reach a user.

`pip install ckpt-guard` installs every command; each role's libraries come with its extra.
``--help`` works on the base install, and a command whose imports fail names the extra
instead of ending in a traceback. A file that is not there or not writable is one line,
not a traceback. With ``--json`` an error is JSON on stdout, ``{"error", "exit_code"}``,
like the output a script parses; exit codes stay 1 (failure) and 2 (usage)."""
from __future__ import annotations

import json
import sys

import click


def role_group(extra: str) -> type[click.Group]:
    """A click group class for the role installed by ``pip install 'ckpt-guard[EXTRA]'``."""

    class RoleGroup(click.Group):
        def invoke(self, ctx: click.Context):
            try:
                return super().invoke(ctx)
            except ModuleNotFoundError as e:
                raise click.ClickException(f"{e}: this command needs pip install 'ckpt-guard[{extra}]'") from None
            except OSError as e:
                raise click.ClickException(str(e)) from None

        def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **kwargs):
            argv = sys.argv[1:] if args is None else list(args)
            if "--json" not in argv or not standalone_mode:
                return super().main(args, prog_name, complete_var, standalone_mode, **kwargs)
            try:
                code = super().main(argv, prog_name, complete_var, False, **kwargs)
            except click.ClickException as e:
                code = _json_error(e.format_message(), e.exit_code)
            except click.Abort:
                code = _json_error("aborted", 1)
            sys.exit(code if isinstance(code, int) else 0)

    return RoleGroup


def _json_error(message: str, code: int) -> int:
    click.echo(json.dumps({"error": message, "exit_code": code}))
    return code
