"""Relinks a moved or copied local sweep folder to its own MLflow artifacts (``qed-ray relink DIR``).

MLflow records artifact locations as absolute paths, so a moved or copied folder's store still points into the
original (docs/results.md, "A moved or copied folder"); a location anywhere else is relinked too (an edited store
could send the re-analysis's artifacts out of the folder).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from qed_ray.spec import cli_help
from qed_ray.records.layout import SweepDir
from qed_ray.records.sweep import sweep_id as read_sweep_id
from qed_ray.service.mlflow.tags import SWEEP_TAG

SQLITE_PREFIX = "sqlite:///"


@dataclass(frozen=True)
class Relinked:
    """What :func:`relink` changed: the artifact roots the store pointed at, the new one, and how many rows."""

    old: tuple[str, ...]
    new: str
    experiments: int
    runs: int


def _local_path(location: str) -> Path | None:
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    return Path(location) if parsed.scheme == "" else None


def _elsewhere(location: str, root: Path) -> bool:
    path = _local_path(location)
    return path is None or os.path.realpath(path) != os.path.realpath(root)


def _moved_from(location: str, root: Path) -> bool:
    path = _local_path(location)
    return path is not None and path.name == root.name


def relink(db: Path, artifact_root: Path, sweep_id: str) -> Relinked:
    """Points every artifact location of sweep ``sweep_id``'s experiments in the SQLite store ``db`` (with their
    runs and logged models) that lies elsewhere into ``artifact_root``, in one transaction."""
    root = Path(artifact_root).absolute()
    old, n_exp, n_runs = [], 0, 0
    with sqlite3.connect(db, timeout=60) as conn:  # commits on success, rolls back on an error
        rows = conn.execute("SELECT e.experiment_id, e.artifact_location FROM experiments e WHERE e.experiment_id "
                            "IN (SELECT r.experiment_id FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                            "WHERE t.key = ? AND t.value = ?)", (SWEEP_TAG, sweep_id)).fetchall()
        models = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'logged_models'"
                              ).fetchone()
        for exp_id, location in rows:
            if not location or not _elsewhere(location, root):
                continue
            new = root.as_uri() if location.startswith("file:") else str(root)
            conn.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (new, exp_id))
            n_runs += _replace_prefix(conn, "runs", "artifact_uri", exp_id, location, new)
            if models:
                _replace_prefix(conn, "logged_models", "artifact_location", exp_id, location, new)
            old.append(location)
            n_exp += 1
    conn.close()
    return Relinked(tuple(old), str(root), n_exp, n_runs)


def _replace_prefix(conn: sqlite3.Connection, table: str, column: str, exp_id, old: str, new: str) -> int:
    """``old/...`` -> ``new/...`` in ``table.column`` for the experiment's rows; returns how many changed."""
    prefix = old.rstrip("/") + "/"
    cursor = conn.execute(f"UPDATE {table} SET {column} = ? || substr({column}, ?) WHERE experiment_id = ? AND "
                          f"substr({column}, 1, ?) = ?", (new.rstrip("/") + "/", len(prefix) + 1, exp_id,
                                                          len(prefix), prefix))
    return cursor.rowcount


def own_store(uri: str, layout: SweepDir) -> bool:
    return (uri.startswith(SQLITE_PREFIX)
            and os.path.realpath(uri[len(SQLITE_PREFIX):]) == os.path.realpath(layout.mlflow_db))


def forget_artifact_repos() -> None:
    """Drops the artifact repositories (with their old locations) this process's MLflow clients cached per run."""
    from mlflow.tracking._tracking_service import utils

    cache = getattr(utils, "_artifact_repos_cache", None)  # MLflow 3's cache; absent elsewhere: nothing to drop
    if cache is not None:
        cache.clear()


def follow_move(layout: SweepDir, sweep_id: str | None = None,
                log: Callable[[str], None] = lambda line: print(line, flush=True)) -> Relinked | None:
    """Relinks the sweep folder's own store if the folder was moved or copied, logging one line when it changed
    something; None if the folder has no store."""
    if not layout.mlflow_db.exists():
        return None
    sweep_id = sweep_id or read_sweep_id(layout)
    done = relink(layout.mlflow_db, layout.mlartifacts, sweep_id)
    if done.experiments:
        forget_artifact_repos()  # clients of this process cached the old locations
        why = ("was moved or copied" if all(_moved_from(o, layout.mlartifacts) for o in done.old) else
               "had its store send artifacts out of the folder")
        log(f"MLflow: {layout.root} {why}: pointed {done.runs} run(s) of its store from {', '.join(done.old)} to "
            f"{done.new}")
    return done


def main(argv: list[str] | None = None) -> int:
    p = cli_help.parser("qed-ray relink", __doc__, (
        "mv results/smoke archive/smoke && qed-ray relink archive/smoke   # after a move",
        "cp -r results/smoke /data/smoke && qed-ray relink /data/smoke    # a copy keeps its own"))
    p.add_argument("sweep_dir", type=Path, help="the moved or copied sweep folder (with sweep.json and mlflow.db)")
    layout = SweepDir(p.parse_args(argv).sweep_dir.absolute())
    problem = (f"{layout.root} is not a sweep folder (no {layout.state_file.name})" if not layout.state_file.exists()
               else f"{layout.root} has no MLflow store ({layout.mlflow_db.name}): a sweep tracked by an MLflow server "
                    f"keeps its artifacts there, nothing to relink" if not layout.mlflow_db.exists() else None)
    try:
        if problem:
            raise ValueError(f"sweep_dir: {problem}")
        done = follow_move(layout)
    except ValueError as e:  # also a damaged sweep.json (SpecError, naming the file and the field)
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not done.experiments:
        print(f"nothing to relink: no artifact location of this sweep in {layout.mlflow_db} points outside "
              f"{layout.mlartifacts}")
    return 0
