"""Fills the cluster configs' placeholders in from one env file: python cluster/fill.py [--values FILE] [--out DIR]

Reads cluster/values.env (VARIABLE=value lines; cluster/values.env.example lists every variable, what to put there
and which cluster needs it) and writes a copy of every config of cluster/ (the launcher configs, the KubeRay
manifests, iam/, the Filestore flags) into cluster/filled/, each placeholder whose variable is set replaced by its
value. The templates are never written, the copies always rewritten (edit the values or the templates, never the
copies). Idempotent: the same values give the same bytes. Refuses, writing nothing,
an unknown variable and a value that is empty, malformed or itself a placeholder, naming the line. Then:
python cluster/check.py aws|gcp|kuberay, and launch the copies (ray up cluster/filled/aws.yaml).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the preflight package beside this file

from preflight.placeholders import (FILLED, TEMPLATES, VALUES, ValuesError, fill, find_placeholders,  # noqa: E402
                                    read_values, target_files)


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def write_filled(root: Path, values: dict[str, str], out: Path) -> dict[str, list[str]]:
    """Writes the filled-in copies of every target's configs into ``out``; returns {target: variables still unset}."""
    templates, left = root / TEMPLATES, {}
    for target, names in target_files(templates).items():
        for name in names:
            text = fill((templates / name).read_text(), values)
            dest = out / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            if not dest.exists() or dest.read_text() != text:  # unchanged files keep their times
                dest.write_text(text)
        left[target] = list(dict.fromkeys(f.placeholder.variable for f in find_placeholders(out, "", names)))
    return left


def main(argv: list[str] | None = None) -> int:
    """Fills in and prints what was written and what is left; 0, or 2 when the values are refused."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository checkout whose templates are filled in (default: this one)")
    parser.add_argument("--values", type=Path, default=None, help=f"the env file (default: {VALUES})")
    parser.add_argument("--out", type=Path, default=None, help=f"where the copies go (default: {FILLED}/)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    values_path, out = (args.values or root / VALUES).resolve(), (args.out or root / FILLED).resolve()
    if not values_path.is_file():
        print(f"error: {_shown(values_path, root)}: no such file (start from cluster/values.env.example: "
              f"cp cluster/values.env.example {VALUES})", file=sys.stderr)
        return 2
    try:
        values = read_values(values_path, _shown(values_path, root))
    except ValuesError as err:
        print("\n".join(f"error: {line}" for line in str(err).splitlines()), file=sys.stderr)
        print(f"nothing written to {_shown(out, root)}/", file=sys.stderr)
        return 2
    left = write_filled(root, values, out)
    print(f"wrote {_shown(out, root)}/ from {_shown(values_path, root)} ({len(values)} variable(s) set)")
    for target, unset in left.items():
        print(f"  {target}: " + (f"still needs {', '.join(unset)}" if unset else
                                 f"ready for python cluster/check.py {target}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
