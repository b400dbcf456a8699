"""The docs match the code: every `qed_ray/...` path README.md and docs/ name exists, every `qed-ray ...` and
`python -m ...` command they name answers `--help` with its own usage line, the README's headline caption is the one scripts/headline.py
writes from the committed data file, and the Makefile's recipes echo no comments."""

import importlib.util
import io
import json
import os
import re
import runpy
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A repository path: not the tail of another path (`~/.config/qed_ray/results.key`); placeholders (`<trial>`, `*`)
# end it, and so does trailing punctuation.
PATH = re.compile(r"(?<![\w./~-])qed_ray/[\w./-]*\w|(?<![\w./~-])qed_ray/")
COMMAND = re.compile(r"python -m (qed_ray(?:\.\w+)+)|python (scripts/\w+\.py)|(qed-ray [a-z]+)")


def _named(pattern: re.Pattern) -> dict[str, list[str]]:
    """{what the docs name: [the files naming it]}."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for match in pattern.finditer(doc.read_text()):
            found.setdefault(match.group(0) if pattern is PATH else next(g for g in match.groups() if g), []).append(
                doc.relative_to(ROOT).as_posix())
    return found


def test_every_named_path_exists():
    paths = _named(PATH)
    assert "qed_ray/records/layout.py" in paths and "qed_ray/rl/temperature.py" in paths  # the scan finds what is there
    missing = {p: sorted(set(docs)) for p, docs in paths.items() if not (ROOT / p).exists()}
    assert not missing, f"named in the docs, not in the repository: {missing}"


def _help(command: str) -> str:
    """``qed-ray COMMAND --help``, ``python -m MODULE --help`` or ``python SCRIPT --help`` in this process: its stdout.
    The environment and sys.argv are restored afterwards (an entry point may set variables before parsing)."""
    saved_env, saved_argv, out = dict(os.environ), sys.argv, io.StringIO()
    sys.argv = [command, "--help"]
    try:
        with redirect_stdout(out), pytest.raises(SystemExit) as done:
            if command.startswith("qed-ray "):
                from qed_ray.cli import main

                raise SystemExit(main([command.split()[1], "--help"]))
            elif command.endswith(".py"):
                runpy.run_path(str(ROOT / command), run_name="__main__")
            else:
                runpy.run_module(command, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    assert done.value.code in (0, None), (command, done.value.code)
    return out.getvalue()


def test_every_named_command_answers_help():
    commands = _named(COMMAND)
    assert {"qed-ray sweep", "qed-ray run", "qed-ray gather", "qed_ray.sweep", "scripts/headline.py"} <= set(commands)
    for command, docs in sorted(commands.items()):
        text = _help(command)
        usage = (f"usage: python {command}" if command.endswith(".py") else f"usage: {command}"
                 if command.startswith("qed-ray ") else f"usage: qed-ray {command.removeprefix('qed_ray.')}")
        assert text.startswith(usage), (command, sorted(set(docs)), text[:200])


def _headline():
    spec = importlib.util.spec_from_file_location("headline", ROOT / "scripts" / "headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_caption_is_the_one_the_data_file_gives():
    headline = _headline()
    data = json.loads(headline.DATA.read_text())
    point, lower, upper = data["V_ratio_median"]
    assert lower <= point <= upper and data["V_mean"][data["baseline"]] / data["V_mean"][data["variant"]] > 0
    assert headline.FIGURE.is_file() and headline.FIGURE.stat().st_size > 10_000
    block = headline.readme_block((ROOT / "README.md").read_text())
    assert block == headline.block(data), "README's headline differs from docs/img/smoke_pareto.json: run " \
                                          "scripts/headline.py on a demo's folder"
    assert headline._ci(data["V_ratio_median"]) in block  # the quoted ratio is the data file's, as the table prints


def test_a_null_in_the_data_file_is_printed_as_no_estimate():
    headline = _headline()
    assert headline._ci([4.1, None, 5.8]) == "-" and headline._ci([4.12, 2.811, 5.818]) == "4.12 [2.81, 5.82]"


def test_the_makefile_echoes_no_comments():
    recipe_comments = [ln for ln in (ROOT / "Makefile").read_text().splitlines() if re.match(r"\t\s*#", ln)]
    assert recipe_comments == [], "make prints a recipe's comment lines; put them above the target"


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case; punctuation but '-' and '_' dropped)."""
    heads, fenced = [], False
    for line in doc.read_text().splitlines():
        fenced ^= line.lstrip().startswith("```")  # a fence line opens or closes a code block
        if not fenced and (head := re.match(r"#+ (.+)", line)):
            heads.append(head.group(1))
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]+))?\)", doc.read_text()):
            path = (doc.parent / target).resolve() if target else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{doc.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []
