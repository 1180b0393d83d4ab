"""Which extra a role's command needs, said when one of its libraries is missing.

`pip install ckpt-guard` installs every command (`agents`, `predictor`); each role's
libraries come with its extra. ``--help`` works on the base install; a command whose
imports fail names the extra instead of ending in a traceback."""
from __future__ import annotations

import click


def group_needing(extra: str) -> type[click.Group]:
    """A click group class whose commands, when an import fails, exit 1 naming ``extra``."""

    class Group(click.Group):
        def invoke(self, ctx: click.Context):
            try:
                return super().invoke(ctx)
            except ModuleNotFoundError as e:
                raise click.ClickException(f"{e}: this command needs pip install 'ckpt-guard[{extra}]'") from None

    return Group
