"""``ckpt simulate`` as the ``ckpt`` group registers it: a stand-in that loads the goodput
simulator (``ckpt.goodput``) only when the command runs or shows its help, so neither
the engine nor ``ckpt --help`` imports it."""
from __future__ import annotations

import click


class _LazyCommand(click.Command):
    """Hands parsing, help and invocation to the real command, imported on first use."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: object) -> click.Context:
        from .goodput.command import simulate_cmd

        return simulate_cmd.make_context(info_name, args, parent, **extra)


simulate_cmd = _LazyCommand("simulate", help="ETTR and waste of checkpointing strategies over a long run "
                            "(goodput simulator; see docs/goodput.md).")
