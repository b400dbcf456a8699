"""The house rules, read from every module's imports with ``ast``: the RL wing imports neither Ray nor MLflow, the
analysis wing no Ray (and no MLflow: the service logs), only the entry points import the service wing, the shared
floor imports no wing, no import circle, no ``__main__`` block in a library module, and no file over 450 lines. The rules must catch a module that
breaks them (checked with temporary modules)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "qed_ray"
WINGS = ("rl", "analysis", "service", "paper")
# The entry points: `python -m qed_ray.X` (and the console scripts) hand over to their wing from these alone.
ENTRY_POINTS = {"qed_ray.sweep", "qed_ray.train", "qed_ray.gather", "qed_ray.visualize", "qed_ray.toy",
                "qed_ray.theory", "qed_ray.envs", "qed_ray.relink", "qed_ray.pack_run", "qed_ray.analysis.__main__"}
FORBIDDEN = {"rl": ("ray", "mlflow"), "analysis": ("ray", "mlflow")}
MAX_LINES = 450


def module_name(path: Path, root: Path = ROOT) -> str:
    """``qed_ray.rl.trainer`` for ``qed_ray/rl/trainer.py`` (a package is its ``__init__``'s name)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports for annotations only: no module loads them)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield node
        yield from _runtime_nodes(node)


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports at run time, at module level or inside a function (absolute names;
    ``from pkg import mod`` counts as ``pkg.mod`` when it is one)."""
    tree, out = ast.parse(path.read_text()), set()
    package = module_name(path, root).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path, root)
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


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
        wing = name.split(".")[1] if name.count(".") >= 1 and name.split(".")[1] in WINGS else None
        external = {i.split(".")[0] for i in imports_of(path, root)}
        for banned in FORBIDDEN.get(wing, ()):
            if banned in external:
                out.append(f"{name}: the {wing} wing imports {banned}")
        service = sorted(i for i in edges[name] if i.startswith("qed_ray.service"))
        if service and wing != "service" and name not in ENTRY_POINTS:
            out.append(f"{name}: imports {service[0]} (only the entry points import the service wing)")
        upward = sorted(i for i in edges[name] if i.split(".")[1:2] and i.split(".")[1] in WINGS)
        if wing is None and upward and name not in ENTRY_POINTS and name != "qed_ray":
            out.append(f"{name}: the shared floor imports {upward[0]} (a wing builds on the floor, never under it)")
        if name not in ENTRY_POINTS and re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M):
            out.append(f"{name}: a __main__ block in a library module (entry points: {sorted(ENTRY_POINTS)})")
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            out.append(f"{name}: {lines} lines (at most {MAX_LINES})")
    out += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    return out


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


def test_the_rl_core_stays_free_of_ray_mlflow_and_the_service():
    edges = graph()
    rl = [m for m in edges if m.startswith("qed_ray.rl")]
    assert len(rl) > 15 and not any(i.startswith(("qed_ray.service", "qed_ray.analysis")) for m in rl
                                    for i in edges[m]), "rl imports only the floor and itself"


@pytest.mark.parametrize("wing, source, needle", [
    ("rl", "import ray\n", "qed_ray.rl.broken: the rl wing imports ray"),
    ("rl", "from mlflow.tracking import MlflowClient\n", "qed_ray.rl.broken: the rl wing imports mlflow"),
    ("analysis", "import ray.tune\n", "qed_ray.analysis.broken: the analysis wing imports ray"),
    ("paper", "from qed_ray.service import sweep\n", "qed_ray.paper.broken: imports qed_ray.service"),
    ("rl", "from qed_ray.rl import broken_too\n", "import circle: qed_ray.rl.broken -> qed_ray.rl.broken_too"),
    ("rl", "if __name__ == '__main__':\n    pass\n", "qed_ray.rl.broken: a __main__ block in a library module"),
    ("", "from qed_ray.rl import trainer\n", "qed_ray.broken: the shared floor imports qed_ray.rl"),
    ("rl", "x = 1\n" * 451, "qed_ray.rl.broken: 451 lines (at most 450)"),
])
def test_a_module_that_breaks_a_rule_is_caught(tmp_path, wing, source, needle):
    import shutil

    copy = tmp_path / "qed_ray"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (copy / wing / "broken.py").write_text(source)
    (copy / wing / "broken_too.py").write_text(f"from {'.'.join(filter(None, ('qed_ray', wing)))} import broken\n")
    assert any(line.startswith(needle) for line in problems(copy)), problems(copy)
