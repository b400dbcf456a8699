"""Re-analysis of a sweep from its saved policies with other final-evaluation settings (``python -m qed_ray.gather``).

No retraining and no Ray, and never worse than before: a refused folder is refused before anything is read, and a
re-analysis that would leave every trial out keeps the previous outputs (docs/running.md, docs/results.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from pydantic import ValidationError

from qed_ray.spec import cli_help, console
from qed_ray.analysis import group_cache, report
from qed_ray.analysis.checksums import Verifier
from qed_ray.analysis.gather_engine import GatherEngine
from qed_ray.analysis.outputs import policy_dir
from qed_ray.analysis.results import FailedTrial, GroupResult, SweepResults, read_results
from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.labels import settings_label
from qed_ray.records.layout import SweepDir
from qed_ray.service.lock import LockHeld, SweepLock
from qed_ray.service.results_key import ResultsKey, ResultsKeyError, key_path, load_key
from qed_ray.service.status import driver, sweep_folders_in
from qed_ray.records.sweep import read_state, sweep_id, verified_claim
from qed_ray.service.mlflow.tracking_uri import given_uri
from qed_ray.spec.sweep import FinalEvalSpec

# Settings of the final evaluation a re-analysis may change (keep_every decided which snapshots exist: fixed).
FLAGS = ("policies", "episodes", "action_rollouts", "action_steps", "curve_episodes", "bootstrap_reps",
         "confidence", "seed", "proxy_window")


def reanalysis_dir(layout: SweepDir, final_eval: FinalEvalSpec, sweep_settings: FinalEvalSpec | None) -> Path:
    """``gather/reanalysis-<settings>/``: named for the settings that differ from the sweep's own, ``+`` between
    them (``reanalysis-episodes=20+seed=3``); ``reanalysis-sweep-settings`` when none do."""
    base = (sweep_settings or FinalEvalSpec()).model_dump(mode="json")
    label = settings_label(final_eval.model_dump(mode="json"), {f"final_eval.{k}": str(v) for k, v in base.items()},
                           FLAGS)
    return layout.reanalysis("sweep-settings" if label == "sweep settings" else label.replace(" ", "+"))


def previous_results(layout: SweepDir) -> SweepResults | None:
    """The last ``results.json`` (None when the sweep was never gathered); raises RecordError naming a damaged one."""
    return read_results(layout.results_json) if os.path.lexists(layout.results_json) else None


def final_eval_with(base: FinalEvalSpec | None, overrides: dict) -> FinalEvalSpec:
    """The base settings with the overrides; raises ValueError naming the flag of any bad value."""
    try:
        return FinalEvalSpec.model_validate({**(base.model_dump() if base else {}), **overrides})
    except ValidationError as e:
        lines = []
        for line in format_validation_error(e).splitlines():
            field, sep, rest = line.partition(": ")
            lines.append(f"--{field.replace('_', '-')}: {rest}" if sep and field in FLAGS else line)
        raise ValueError("\n".join(lines)) from None


class _NoDeprecations(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "is deprecated" not in record.getMessage()


def quiet_model_deprecations() -> None:
    """Drops MuJoCo's deprecation notices, which dm_control passes to absl's logger each time it builds a task's
    model (cheetah's ``settotalmass``: 60 lines in a re-analysis); a sweep's workers print none to its console
    either. Other absl warnings (a physics instability, say) still show."""
    absl = logging.getLogger("absl")
    if not any(isinstance(f, _NoDeprecations) for f in absl.filters):
        absl.addFilter(_NoDeprecations())


def _evaluate_in_worker(job: group_cache.GroupJob, final_eval: FinalEvalSpec) -> GroupResult:
    import torch

    torch.set_num_threads(1)
    quiet_model_deprecations()
    return group_cache.evaluate(job, final_eval)


def reanalyze(layout: SweepDir, final_eval: FinalEvalSpec, verifier: Verifier | None, workers: int = 1, log=print,
              signing_key: bytes | None = None, claim: dict | None = None) -> tuple[SweepResults, list[str]]:
    """Computes every output ``gather/`` holds into :func:`reanalysis_dir` (nothing when every trial is left out);
    returns the results and the refused groups. ``verifier`` None (``--no-verify``): every seed is unverified;
    ``signing_key`` None: the cache is left alone."""
    trials = [t.name for t in layout.trials()]
    old = previous_results(layout)
    finished = [n for n in trials if layout.done_marker(n).exists()]
    engine = GatherEngine(layout, final_eval, signing_key, log, progress=log)
    engine.exclude([f for f in (old.failed_trials if old else []) if f.name not in trials and "/" in f.name])
    engine.exclude(FailedTrial(n, "did not finish (no DONE.json)") for n in trials if n not in finished)
    groups = [(key, [n for n in names if n in finished]) for key, names in group_cache.plan_groups(trials).items()]
    if workers > 1:
        spawn = get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=spawn) as pool, ThreadPoolExecutor(workers) as each:
            def evaluate(job: group_cache.GroupJob) -> GroupResult:
                return pool.submit(_evaluate_in_worker, job, final_eval).result()
            list(each.map(lambda g: engine.group(*g, verifier, evaluate), groups))
    else:
        for key, done in groups:
            engine.group(key, done, verifier)
    n_trials = max(old.n_trials if old else 0, len(trials) + len([f for f in engine.excluded if f not in trials]))
    out = engine.sweep_results(old.sweep if old else layout.root.name, n_trials, claim,
                               judge=not layout.search_file.exists())  # a k search is never judged
    if out.groups:
        engine.write(out, reanalysis_dir(layout, final_eval, old.final_eval if old else None))
    return out, engine.refused


def _log_to_mlflow(layout: SweepDir, uri: str | None, results: SweepResults, refused: list[str], folder: Path) -> str:
    """The re-analysis as a child run of the sweep's parent run (best-effort); returns the line to print."""
    from qed_ray.service.mlflow.mirror import log_reanalysis
    from qed_ray.service.mlflow.relink import follow_move
    from qed_ray.service.mlflow.tracking import default_tracking_uri

    if uri is None:
        if not layout.mlflow_db.exists():
            return "MLflow: not updated: no tracking URI given and no mlflow.db in the sweep folder"
        uri = default_tracking_uri(layout.root)
        follow_move(layout)  # artifacts go into this folder's mlartifacts/, not the one it was copied from
    try:
        return log_reanalysis(uri, sweep_id(layout), results, layout, FLAGS, refused, folder)
    except Exception as e:  # noqa: BLE001 - MLflow mirrors the folder; the new tables are in gather/ either way
        return f"WARNING: MLflow not updated ({type(e).__name__}: {' '.join(str(e).split())[:300]}); the results " \
               f"are in {layout.gather}"


def _verifier(layout: SweepDir, uri: str | None, key: bytes) -> Verifier:
    from qed_ray.service.mlflow.relink import follow_move
    from qed_ray.service.mlflow.tracking import default_tracking_uri, sweep_digests

    if uri is None:
        if not layout.mlflow_db.exists():
            raise ValueError(f"--tracking-uri: no MLflow store in {layout.root} (mlflow.db) and MLFLOW_TRACKING_URI "
                             f"is not set; give the sweep's tracking URI, or --no-verify to trust the folder")
        uri = default_tracking_uri(layout.root)
        follow_move(layout)  # a moved or copied folder's store points at its own artifacts again
    elif uri.startswith("sqlite:") and not Path(uri.removeprefix("sqlite:").removeprefix("///")).is_file():
        # MLflow would create an empty store there (and every trial would be unverified for want of digests).
        raise ValueError(f"--tracking-uri: {uri}: no MLflow store at that path (a SQLite URI needs an existing "
                         f"file: sqlite:////abs/path/mlflow.db)")
    sid = sweep_id(layout)
    recorded = sweep_digests(uri, sid)
    if not recorded and any(layout.done_marker(t.name).exists() for t in layout.trials()):
        # Every seed would be unverified: the wrong store, far likelier than an outage at every trial's end.
        raise ValueError(f"--tracking-uri: {uri}: holds no signed digest of this sweep's trials (sweep id {sid}); "
                         f"give the sweep's tracking URI, or --no-verify to use its files unchecked")
    return Verifier(sid, key, recorded)


def _key(layout: SweepDir, no_verify: bool) -> ResultsKey | None:
    """The user's results key; with ``--no-verify`` a missing key only leaves the cache unused."""
    try:
        return load_key(sweep_dir=layout.root)
    except ResultsKeyError:
        if not no_verify or key_path().exists():
            raise
        print(f"note: no results key at {key_path()}: the cache is neither read nor written", flush=True)
        return None


def check_folder(layout: SweepDir) -> None:
    """Refuses (ValueError) a folder a live driver holds, a folder where an output file belongs and a ``gather/``
    holding a symbolic link out of the sweep folder (LockHeld for a folder or dangling link as ``sweep.lock``)."""
    holder = driver(layout)
    if holder is not None:
        raise ValueError(f"sweep_dir: a driver runs this sweep now ({holder}, {layout.lock_file}); re-analyse after "
                         f"it ends (its own gather step rewrites {layout.gather})")
    for path in (layout.aggregates_csv, layout.groups_csv, layout.budgets_csv, layout.comparisons_csv,
                 layout.verdict_json):
        if path.is_dir():
            raise ValueError(f"sweep_dir: {path} is a folder where the re-analysis writes a file; move it away")
    root = layout.root.resolve()
    for folder, dirs, files in os.walk(layout.gather) if os.path.lexists(layout.gather) else ():
        for entry in [layout.gather] + [Path(folder) / n for n in dirs + files]:
            if entry.is_symlink() and root not in entry.resolve().parents:
                raise ValueError(f"sweep_dir: {entry} is a symbolic link to {entry.resolve()}, outside the sweep "
                                 f"folder; refusing to write through it (replace it with a folder or file of its own)")


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = cli_help.parser("qed-ray gather", __doc__, (
        "qed-ray gather results/smoke --episodes 20   # more final-evaluation episodes; no retraining",
        "qed-ray gather results/smoke --policies mean,sample --workers 2   # also sampled actions"))
    p.add_argument("sweep_dir", type=Path, help="the sweep folder (with sweep.json and policies/)")
    for name in FLAGS:
        info = FinalEvalSpec.model_fields[name]
        kind = {float: float, int: int}.get(info.annotation, _name_list)
        default = ",".join(info.default) if isinstance(info.default, tuple) else info.default
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{info.description} (default: the "
                       f"sweep's last gather, else {default})".replace("%", "%%"))
    p.add_argument("--workers", type=int, default=1, help="local processes evaluating groups (default 1)")
    p.add_argument("--tracking-uri", help="MLflow store with the digests the trials signed (default: "
                   "MLFLOW_TRACKING_URI, else the sweep folder's mlflow.db)")
    p.add_argument("--no-verify", action="store_true", help="use the snapshots without checking them against the "
                   "digests their trials signed (every seed is reported unverified; only for a folder nobody else "
                   "could write)")
    p.add_argument("--allow-unverified", action="store_true", help="exit 0 even when seeds were used unverified "
                   "(their trials recorded no digest; default: exit 1)")
    return p.parse_args(argv)


def refuse_unverified(results: SweepResults | None, allowed: bool) -> bool:
    """Whether the exit code must say that seeds were used unverified, printing the line that says so."""
    n = sum(len(g.unverified_seeds) for g in results.groups) if results is not None else 0
    if n and not allowed:
        print(f"error: {n} seed{'s were' if n > 1 else ' was'} used unverified (the UNVERIFIED line above): exit 1; "
              f"--allow-unverified accepts them", file=sys.stderr, flush=True)
    return bool(n) and not allowed


def _error(e: Exception) -> int:
    for line in str(e).splitlines():
        print(f"error: {line}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Exit code 0 done, 1 a group was refused or seeds were used unverified (unless ``--allow-unverified`` or
    ``--no-verify``), 2 bad input."""
    args = parse_args(argv)
    layout = SweepDir(args.sweep_dir.resolve())
    try:
        if not os.path.lexists(layout.state_file):
            inside = sweep_folders_in(layout.root)  # given the storage root, say
            hint = f"; it holds the sweep folder(s) {', '.join(d.name for d in inside)}: give {inside[0]}" \
                if inside else ""
            raise ValueError(f"sweep_dir: {layout.root} is not a sweep folder (no {layout.state_file.name}){hint}")
        sweep_id(layout)  # a damaged sweep.json: refused naming it
        check_folder(layout)
        if args.workers < 1:
            raise ValueError(f"--workers: {args.workers}; need 1 or more")
        overrides = {k: getattr(args, k) for k in FLAGS if getattr(args, k) is not None}
        previous = previous_results(layout)
        final_eval = final_eval_with(previous.final_eval if previous else None, overrides)
        uri = given_uri(args.tracking_uri)
        key = _key(layout, args.no_verify)
        verifier = None if args.no_verify else _verifier(layout, uri, key.secret)
        claim = verified_claim(read_state(layout), None if verifier is None else key.secret)
        layout.trials()  # a folder without policies/ is refused here, naming it
        lock = SweepLock(layout.lock_file)
        lock.acquire()  # a driver that starts meanwhile is refused (it writes gather/ too)
    except (ValueError, FileNotFoundError, LockHeld) as e:  # RecordError and SpecError are ValueErrors
        return _error(e)
    os.environ.setdefault("MUJOCO_GL", "disable")
    quiet_model_deprecations()
    print(f"re-analysing {layout.root} with final_eval {final_eval.model_dump()}", flush=True)
    try:
        results, refused = reanalyze(layout, final_eval, verifier, args.workers,
                                     signing_key=key.secret if key is not None else None, claim=claim)
    except (ValueError, FileNotFoundError) as e:
        return _error(e)
    finally:
        lock.release()
    folder = reanalysis_dir(layout, final_eval, previous.final_eval if previous else None)
    if not results.groups:
        for f in results.failed_trials:
            print(f"LEFT OUT {f.name}: {f.error}")
        print(f"error: every trial was left out, so {folder} keeps its previous outputs (a wrong "
              f"--tracking-uri, or no trial finished?)", file=sys.stderr)
        return 1
    columns = console.width()
    print("\n" + report.summary(results, layout if verifier is not None else None, columns))
    for policy, other in results.other_policies.items():
        print(f"\nevaluation policy {policy} ({folder / policy_dir(layout, policy).name}):")
        print(report.summary(other, columns=columns))
    for f in results.failed_trials:
        print(f"LEFT OUT {f.name}: {f.error}")
    print(f"\nwrote {folder} (the sweep's own settings stay in {layout.gather})")
    print(_log_to_mlflow(layout, uri, results, refused, folder))
    unverified = refuse_unverified(results, args.allow_unverified or args.no_verify)  # --no-verify: chosen
    return 1 if refused or unverified else 0
