"""What every command's ``--help`` shows: a plain one-line description and examples that run as given.

The entry points' docstrings are written for the API docs (````code````, ``:mod:`x```), but a terminal prints them as
typed, so :func:`plain` strips that markup from the description. Each command's help ends with examples (at least
two) that run from the repository root in its virtual environment (``source .venv/bin/activate``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

_ROLE = re.compile(r":(?:func|mod|class|meth|attr|data|exc|obj|ref):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reStructuredText markup: ````code```` -> code, ``:func:`a.b``` -> a.b (``~a.b`` -> a.b)."""
    return _LITERAL.sub(r"\1", _ROLE.sub(r"\1", text))


def epilog(examples: Sequence[str], more: str = "") -> str:
    """The help's closing text: ``examples`` (``command  # what it does``), then ``more`` (kept as written)."""
    text = "examples (from the repository root, after: source .venv/bin/activate):\n"
    text += "\n".join(f"  {e}" for e in examples)
    return text + (f"\n\n{more}" if more else "")


def parser(prog: str, description: str, examples: Sequence[str], more: str = "") -> argparse.ArgumentParser:
    """An ArgumentParser for ``<prog>`` (``qed-ray COMMAND``): the first line of ``description`` without markup, and
    :func:`epilog` after the flags (printed as written)."""
    if len(examples) < 2:
        raise ValueError(f"{prog}: give at least two examples")
    return argparse.ArgumentParser(prog=prog, description=plain(description.strip().splitlines()[0]),
                                   epilog=epilog(examples, more), formatter_class=argparse.RawDescriptionHelpFormatter)
