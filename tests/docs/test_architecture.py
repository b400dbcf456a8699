"""The house rules, read from every module's imports with ``ast`` (imports under ``if TYPE_CHECKING:`` included):
one wing order, ``spec <- records <- rl <- analysis <- service <- cli`` with ``paper <- rl`` beside analysis, where
a wing imports only the wings below it; only the service imports Ray, and only the service's MLflow modules import
MLflow; no import circle; no ``__main__`` block outside the entry points. A module over 600 lines is a warning,
not a failure. The rules must catch a module that breaks them (checked with temporary modules)."""

import ast
import functools
import itertools
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "qed_ray"
# The entry points (the cli wing): `qed-ray COMMAND` (qed_ray.cli, `python -m qed_ray`) and the shims
# `python -m qed_ray.sweep` and `python -m qed_ray.gather` hand over to their wing from these alone.
ENTRY_POINTS = {"qed_ray.cli", "qed_ray.__main__", "qed_ray.sweep", "qed_ray.gather"}
# A module that sits outside its wing's folder, and the wing it counts in (none today).
PLACED: dict[str, str] = {}
# What each wing may import (itself and the wings below it); the root's other modules are the spec wing.
BELOW = {"spec": set(), "records": {"spec"}, "rl": {"spec", "records"}, "paper": {"spec", "records", "rl"},
         "analysis": {"spec", "records", "rl"}, "service": {"spec", "records", "rl", "analysis"},
         "cli": {"spec", "records", "rl", "paper", "analysis", "service"}}
WINGS = ("records", "rl", "paper", "analysis", "service")
RAY = {"service", "cli"}
MLFLOW_MODULES = {"qed_ray.service.mlflow.tracking", "qed_ray.service.mlflow.relink"}
WARN_LINES = 600


def module_name(path: Path, root: Path = ROOT) -> str:
    """``qed_ray.rl.trainer`` for ``qed_ray/rl/trainer.py`` (a package is its ``__init__``'s name)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wing_of(name: str) -> str:
    """The wing of module ``name``: its folder under ``qed_ray/``, ``cli`` for an entry point, else ``spec``."""
    if name in ENTRY_POINTS:
        return "cli"
    if name in PLACED:
        return PLACED[name]
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "spec"


@functools.lru_cache(maxsize=None)
def _imports(source: str, package: str) -> frozenset[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):  # every import: module level, in functions, under TYPE_CHECKING
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return frozenset(out)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports (absolute names; ``from pkg import mod`` counts as ``pkg.mod`` when it is one)."""
    package = module_name(path, root).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path, root)
    return set(_imports(path.read_text(), package))


def modules(root: Path = ROOT) -> dict[str, Path]:
    """``{module name: file}`` of the package."""
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``{module: the package's modules it imports}``."""
    found = modules(root)
    return {m: {i for i in imports_of(p, root) if i in found and i != m} for m, p in found.items()}


def problems(root: Path = ROOT) -> list[str]:
    """Every broken rule, one line each (empty: the house is in order)."""
    found, edges, out = modules(root), graph(root), []
    for name, path in found.items():
        wing, external = wing_of(name), {i.split(".")[0] for i in imports_of(path, root)}
        if "ray" in external and wing not in RAY:
            out.append(f"{name}: the {wing} wing imports ray (only the service does)")
        if "mlflow" in external and name not in MLFLOW_MODULES and wing != "cli":
            out.append(f"{name}: imports mlflow (only {sorted(MLFLOW_MODULES)} do)")
        for target in sorted(edges[name]):
            if wing_of(target) != wing and wing_of(target) not in BELOW[wing] and name != "qed_ray":
                out.append(f"{name}: the {wing} wing imports {target} of the {wing_of(target)} wing "
                           f"(it may import {sorted(BELOW[wing]) or 'no other wing'})")
        if wing != "cli" and re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M):
            out.append(f"{name}: a __main__ block in a library module (entry points: {sorted(ENTRY_POINTS)})")
    out += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    return out


def long_modules(root: Path = ROOT) -> list[str]:
    """The modules over :data:`WARN_LINES` lines (a warning: split a file where its content splits, not to fit)."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules(root).items()}
    return [f"{name}: {n} lines (over {WARN_LINES})" for name, n in sizes.items() if n > WARN_LINES]


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import circles (one per strongly connected component of more than one module), each closed."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v), on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_wings_exist_and_the_house_rules_hold():
    assert all((ROOT / wing / "__init__.py").exists() for wing in WINGS)
    assert problems() == []
    for line in long_modules():
        warnings.warn(line)


def test_every_wing_holds_modules_and_records_holds_every_file_format():
    edges = graph()
    by_wing = {w: [m for m in edges if wing_of(m) == w] for w in BELOW}
    assert all(len(by_wing[w]) >= 3 for w in BELOW), {w: len(m) for w, m in by_wing.items()}
    assert {"qed_ray.records.codec", "qed_ray.records.layout", "qed_ray.records.run", "qed_ray.records.checkpoint",
            "qed_ray.records.digests", "qed_ray.records.sweep"} <= set(by_wing["records"])


# A module of each wing that a planted import can name.
TARGET = {"spec": "qed_ray.spec.config", "records": "qed_ray.records.codec", "rl": "qed_ray.rl.trainer",
          "paper": "qed_ray.paper.toy", "analysis": "qed_ray.analysis.results", "service": "qed_ray.service.sweep",
          "cli": "qed_ray.sweep"}
FOLDER = {"spec": "", "cli": "", **{w: w for w in WINGS}}
WRONG_WAY = [(a, b) for a, b in itertools.permutations(BELOW, 2) if b not in BELOW[a]]


def _planted(tmp_path: Path, files: dict[str, str]) -> list[str]:
    import shutil

    copy = tmp_path / "qed_ray"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    for rel, source in files.items():
        (copy / rel).write_text(source)
    return problems(copy)


@pytest.mark.parametrize("wing, target", WRONG_WAY)
def test_a_wrong_direction_import_between_any_two_wings_is_caught(tmp_path, wing, target):
    module, source = TARGET[target].rsplit(".", 1)
    folder = FOLDER[wing]
    found = _planted(tmp_path, {f"{folder}/broken.py".lstrip("/"): f"from {module} import {source}\n"})
    name = ".".join(filter(None, ("qed_ray", folder, "broken")))
    assert any(line.startswith(f"{name}: the {wing} wing imports {TARGET[target]} of the {target} wing")
               for line in found), found


def test_the_wing_matrix_leaves_no_pair_unjudged():
    assert len(WRONG_WAY) == 7 * 6 - sum(len(b) for b in BELOW.values()) == 23
    assert ("rl", "paper") in WRONG_WAY and ("analysis", "paper") in WRONG_WAY and ("paper", "analysis") in WRONG_WAY


@pytest.mark.parametrize("folder, files, needle", [
    ("rl", {"rl/broken.py": "import ray\n"}, "qed_ray.rl.broken: the rl wing imports ray"),
    ("records", {"records/broken.py": "import ray.tune\n"}, "qed_ray.records.broken: the records wing imports ray"),
    ("rl", {"rl/broken.py": "from mlflow.tracking import MlflowClient\n"}, "qed_ray.rl.broken: imports mlflow"),
    ("service", {"service/broken.py": "import mlflow\n"}, "qed_ray.service.broken: imports mlflow"),
    ("rl", {"rl/broken.py": "from qed_ray.rl import broken_too\n", "rl/broken_too.py": "from qed_ray.rl import broken\n"},
     "import circle: qed_ray.rl.broken -> qed_ray.rl.broken_too"),
    ("analysis", {"analysis/broken.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                        "    from qed_ray.analysis.broken_too import X\n",
                  "analysis/broken_too.py": "from qed_ray.analysis import broken\n"},
     "import circle: qed_ray.analysis.broken -> qed_ray.analysis.broken_too"),
    ("rl", {"rl/broken.py": "if __name__ == '__main__':\n    pass\n"},
     "qed_ray.rl.broken: a __main__ block in a library module"),
])
def test_a_module_that_breaks_a_rule_is_caught(tmp_path, folder, files, needle):
    found = _planted(tmp_path, files)
    assert any(line.startswith(needle) for line in found), found


def test_a_long_module_is_a_warning_not_a_failure(tmp_path):
    import shutil

    copy = tmp_path / "qed_ray"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (copy / "rl" / "long.py").write_text("x = 1\n" * 601)
    assert problems(copy) == []
    assert "qed_ray.rl.long: 601 lines (over 600)" in long_modules(copy)
