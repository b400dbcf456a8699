"""Pre-flight check of the cluster configs you are about to launch: python cluster/check.py [aws|gcp|kuberay]

Checks the filled-in copies in cluster/filled/ (written by python cluster/fill.py from cluster/values.env), or the
shipped templates in cluster/ while there are none: fails while any placeholder is left in the configs of the
cluster named (default: all three), naming file, line and the variable of cluster/values.env that fills it. Then,
offline (no cloud credentials, no Docker, no Kubernetes): cluster/aws.yaml and cluster/gcp.yaml through Ray's own
launcher validators, cluster/kuberay.yaml through Ray's KubeRay-to-autoscaler conversion, and all of them, the IAM
files in iam/, the Filestore exports, the Dockerfile with its constraints and the ignore files against the
project's layout and trust boundaries (cluster/README.md). --template checks the shipped templates' structure alone
(placeholders allowed). Prints each problem; exit status 1 if there is any.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the preflight package beside this file

from preflight.placeholders import (EXAMPLE, FILLED, TEMPLATES, VALUES, Found, ValuesError,  # noqa: E402
                                   find_placeholders, out_of_date, read_values, target_files)


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _stale(root: Path, configs: Path) -> list[str]:
    """The default copies (cluster/filled/) against the templates and cluster/values.env."""
    try:
        values = read_values(root / VALUES, VALUES)
    except ValuesError as err:
        return str(err).splitlines()
    return out_of_date(root / TEMPLATES, configs, FILLED, values)


def _fill_in_sections(root: Path, configs: Path, targets: list[str]) -> tuple[dict[str, list[str]], list[Found]]:
    """The placeholders left in the targets' configs and, for the default copies, whether they are up to date."""
    names = [n for t in targets for n in target_files(root / TEMPLATES)[t]]
    found = find_placeholders(configs, _shown(configs, root), names)
    sections = {"placeholders": [str(f) for f in found]}
    if configs == root / FILLED and (root / VALUES).is_file():
        sections[f"{FILLED}/ up to date"] = _stale(root, configs)
    return sections, found


def _how_to_fill(found: list[Found]) -> list[str]:
    """What to put into each variable named in ``found``, then how."""
    named = {f.placeholder.variable: f.placeholder for f in found}
    return [f"  {p.variable}: {p.what} (e.g. {p.example})" for p in named.values()] + [
        f"fill them in: cp {EXAMPLE} {VALUES} (if you have none), set the variables above there, then "
        f"python cluster/fill.py"] if found else []


def _folder(root: Path, args: argparse.Namespace) -> Path:
    """The configs checked: the templates (--template), --configs, else the filled-in copies if there are any."""
    if args.template:
        return root / TEMPLATES
    if args.configs:
        return args.configs.resolve()
    return root / FILLED if (root / FILLED).is_dir() else root / TEMPLATES


def main(argv: list[str] | None = None) -> int:
    """Runs every check and prints one line per problem; returns 0 if there is none, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", choices=("aws", "gcp", "kuberay"),
                        help="the cluster you launch: only its configs must be free of placeholders (default: all)")
    parser.add_argument("--template", action="store_true",
                        help="check the shipped templates' structure, placeholders allowed (what CI runs)")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository checkout to check (default: this one)")
    parser.add_argument("--configs", type=Path, default=None,
                        help=f"folder of the configs to check (default: {FILLED}/ if it exists, else {TEMPLATES}/)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    configs = _folder(root, args)
    if not configs.is_dir():
        parser.error(f"--configs {args.configs}: no such folder")
    print(f"checking {_shown(configs, root)}/" + (" (the shipped templates: their structure only)" * args.template))
    import ray  # noqa: F401 - configures Ray's loggers, which the next line then quiets

    from preflight import run_all

    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray's validators log the defaults they fill in at INFO
    results, found = ({}, []) if args.template else _fill_in_sections(
        root, configs, [args.target] if args.target else ["aws", "gcp", "kuberay"])
    results.update(run_all(root, configs))
    for section, problems in results.items():
        print(f"{'ok  ' if not problems else 'FAIL'} {section}")
        for problem in problems:
            print(f"     - {problem}")
    for line in _how_to_fill(found):
        print(line)
    count = sum(len(p) for p in results.values()) - len(found)
    summary = [f"{len(found)} placeholder(s) left"] * bool(found) + [f"{count} problem(s)"] * bool(count)
    print(", ".join(summary) or "all checks passed")
    return 1 if summary else 0


if __name__ == "__main__":
    sys.exit(main())
