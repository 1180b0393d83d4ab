"""The click group of a role's command (`agents`, `predictor`): how its errors reach a user.

`pip install ckpt-guard` installs every command; each role's libraries come with its extra.
``--help`` works on the base install, and a command whose imports fail names the extra
instead of ending in a traceback. A file that is not there or not writable is one line,
not a traceback. Every error is one line starting ``error:`` (``report_error``, used by the
``ckpt`` command too); with ``--json`` it is JSON on stdout, ``{"error", "exit_code"}``,
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
            if not standalone_mode:
                return super().main(args, prog_name, complete_var, standalone_mode, **kwargs)
            argv = sys.argv[1:] if args is None else list(args)
            as_json = "--json" in argv
            try:
                code = super().main(argv, prog_name, complete_var, False, **kwargs)
            except click.ClickException as e:
                code = report_error(_message(e), e.exit_code, as_json)
            except click.Abort:
                code = report_error("aborted", 1, as_json)
            sys.exit(code if isinstance(code, int) else 0)

    return RoleGroup


def report_error(message: str, code: int, as_json: bool) -> int:
    """The one way a command reports an error, so every error line starts the same:
    ``error: MESSAGE`` on stderr, or with ``--json`` ``{"error", "exit_code"}`` on stdout."""
    if as_json:
        click.echo(json.dumps({"error": message, "exit_code": code}))
    else:
        click.echo(f"error: {message}", err=True)
    return code


def _message(e: click.ClickException) -> str:
    """A usage error points at the command's --help (click's own form is three lines)."""
    ctx = getattr(e, "ctx", None)
    if isinstance(e, click.UsageError) and ctx is not None:
        return f"{e.format_message()} (see '{ctx.command_path} --help')"
    return e.format_message()
