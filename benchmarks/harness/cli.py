"""The flags every benchmark shares, spelled the same everywhere: ``--json [OUT]`` (bare or '-': stdout),
``--repeats N`` and ``--quick`` (the smallest run that still exercises every path)."""
from __future__ import annotations

import argparse


def parser(doc: str | None, *, repeats: int | None = None, quick: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose help is the script's docstring, with ``--json``, and
    ``--repeats`` (when given a default) and ``--quick`` (when given what it shrinks)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="OUT",
                    help="also write the results as JSON here (bare or '-': to stdout)")
    if repeats is not None:
        ap.add_argument("--repeats", type=int, default=repeats, help="runs per figure (default %(default)s)")
    if quick is not None:
        ap.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
    return ap
