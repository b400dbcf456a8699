"""The sweep service: ``python -m qed_ray.sweep SPEC`` (or ``ray job submit -- python -m qed_ray.sweep SPEC``).

Joins the Ray cluster it finds (``RAY_ADDRESS`` / a running ``ray start``) or starts an embedded one, runs every
trial of the spec as a Ray Tune trial (resuming the same sweep when run again), gathers each group of finished
policies while the sweep runs (a named actor, :mod:`qed_ray.gather`) for the cross-seed metrics, and logs
everything to MLflow (one parent run per sweep, one child run per trial). Exit code 0 only when every trial
finished and gathering succeeded. ``--status`` prints a sweep's progress from its folder (:mod:`qed_ray.status`).

This module is the driver; what runs inside a trial's Ray worker is :mod:`qed_ray.trial`, and every path in the
sweep folder comes from :class:`qed_ray.layout.SweepDir`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

import ray
from ray import tune

from qed_ray import gather, status, tables
from qed_ray.group_cache import plan_groups
from qed_ray.layout import SweepDir, trial_dirname
from qed_ray.ray_token import private_ray_token, quiet_opt_out_notice
from qed_ray.results import FailedTrial, SweepResults
from qed_ray.spec import SpecError, SweepSpec, load_spec
from qed_ray.tracking import Tracker, default_tracking_uri, ui_command
from qed_ray.trial import TrialContext, train_trial


def trial_name(trial) -> str:
    """A Tune trial's name ``task/agent/variant/seed`` (from its config, no re-validation)."""
    return trial.config["trial"]["name"]


class Progress(tune.Callback):
    """A concise progress view (instead of Tune's tables): trials done/running/failed, env steps, ETA."""

    def __init__(self, total_env_steps: int, every_s: float = 15.0):
        self.total, self.every_s = total_env_steps, every_s
        self.t0 = time.time()
        self.last = 0.0
        self.start_steps: int | None = None

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        now = time.time()
        if now - self.last >= self.every_s:
            self.last = now
            print(self.line(trials), flush=True)

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        print(f"  trial {trial_name(trial)} failed; retrying from its last checkpoint", flush=True)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        print(f"  trial {trial_name(trial)} failed and has no retries left", flush=True)

    def on_experiment_end(self, trials: list, **info) -> None:
        print(self.line(trials), flush=True)

    def line(self, trials: list) -> str:
        """One status line."""
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.status] = counts.get(t.status, 0) + 1
        steps = sum(int((t.last_result or {}).get("env_steps", 0)) for t in trials)
        if self.start_steps is None:
            self.start_steps = steps
        rate = (steps - self.start_steps) / max(time.time() - self.t0, 1e-9)
        eta = f"{(self.total - steps) / rate / 60:.1f} min" if rate > 0 else "-"
        return (f"[{time.strftime('%H:%M:%S')}] trials: {counts.get('TERMINATED', 0)}/{len(trials)} done, "
                f"{counts.get('RUNNING', 0)} running, {counts.get('PENDING', 0)} pending, "
                f"{counts.get('ERROR', 0)} failed | env steps {steps:,}/{self.total:,} "
                f"({100 * steps / max(self.total, 1):.0f}%) | ETA {eta}")


def resolve_paths(spec: SweepSpec) -> tuple[SweepDir, str, str]:
    """The sweep folder, tracking URI and experiment (env vars override the spec's storage and URI)."""
    raw = os.environ.get("QED_STORAGE_PATH") or spec.storage_path
    if "://" in raw:
        # Policy snapshots, replay chunks and DONE markers are plain files read by every node; object stores
        # would need a filesystem layer this version does not have.
        field = "QED_STORAGE_PATH" if os.environ.get("QED_STORAGE_PATH") else "storage_path"
        raise SpecError(f"{field}: {raw!r} is a URI; give a filesystem path (on a cluster: a shared mount such as "
                        f"EFS/NFS, Filestore or a ReadWriteMany volume, mounted at the same path on every node)")
    layout = SweepDir(Path(raw).expanduser().resolve() / spec.name)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.tracking.uri or default_tracking_uri(layout.root)
    return layout, uri, spec.tracking.experiment or spec.name


def sweep_state(layout: SweepDir, spec: SweepSpec, fresh: bool) -> dict:
    """Reads or creates ``sweep.json`` (the sweep's stable id); refuses a changed grid without ``--fresh``."""
    path, root = layout.state_file, layout.root
    if path.exists() and fresh:
        backup = root.with_name(f"{root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(root), backup)
        print(f"--fresh: moved the previous sweep to {backup}")
    if path.exists():
        state = json.loads(path.read_text())
        if state["fingerprint"] != spec.fingerprint():
            raise SpecError(f"{root}: the spec's grid changed since this sweep started; run with --fresh "
                            f"(the old sweep is kept aside) or change 'name'")
        return state
    root.mkdir(parents=True, exist_ok=True)
    state = {"sweep_id": uuid.uuid4().hex[:12], "fingerprint": spec.fingerprint(), "created": time.time()}
    path.write_text(json.dumps(state))
    return state


def dry_run(spec: SweepSpec) -> int:
    """Prints the expanded trial list and the resources it needs; starts nothing."""
    trials = spec.trials()
    runs = [t.run for t in trials]
    layout, uri, exp = resolve_paths(spec)
    print(f"sweep {spec.name}: {len(runs)} trials -> {layout.root}  (MLflow {uri}, experiment {exp})")
    for t in trials:
        r = t.run
        print(f"  {t.name:48s} env_steps={r.train.env_steps:,} hidden={r.agent.hidden} batch={r.agent.batch_size}")
    res = spec.resources
    total = sum(r.train.env_steps for r in runs)
    print(f"per trial: {res.cpu:g} CPU, {res.gpu:g} GPU; all trials at once: {res.cpu * len(runs):g} CPU, "
          f"{res.gpu * len(runs):g} GPU; total env steps {total:,}")
    return 0


def build_tuner(spec: SweepSpec, context: TrialContext, fresh_start: bool, callbacks: list):
    """A new Tuner over the grid, or the restored one when this sweep already has experiment state.

    The context is bound with ``tune.with_parameters`` here, on every start, so a restored sweep runs with the
    driver's current context instead of one pickled into Tune's experiment state.
    """
    root = context.layout.root
    trainable = tune.with_resources(tune.with_parameters(train_trial, context=context),
                                    {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu})
    if not fresh_start and tune.Tuner.can_restore(str(root)):
        print(f"resuming sweep from {root}", flush=True)
        return tune.Tuner.restore(str(root), trainable, resume_unfinished=True, resume_errored=True)
    runs = spec.runs()
    grid = [{"name": t.name, "run": t.run.model_dump(mode="json")} for t in spec.trials()]
    return tune.Tuner(
        trainable, param_space={"trial": tune.grid_search(grid)},
        tune_config=tune.TuneConfig(trial_name_creator=trial_name,
                                    trial_dirname_creator=lambda t: trial_dirname(trial_name(t)),
                                    max_concurrent_trials=spec.max_concurrent_trials),
        run_config=tune.RunConfig(
            name=root.name, storage_path=str(root.parent), verbose=0,
            failure_config=tune.FailureConfig(max_failures=spec.max_retries),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
            callbacks=[Progress(sum(r.train.env_steps for r in runs)), *callbacks]))


def failed_trials(result_grid) -> list[FailedTrial]:
    """The trials Tune gave up on, each with the last line of its error."""
    failed = []
    for result in result_grid:
        if result.error is not None:
            lines = str(result.error).strip().splitlines()
            failed.append(FailedTrial(result.config["trial"]["name"],
                                      lines[-1] if lines else type(result.error).__name__))
    return failed


def check_cluster(spec: SweepSpec, sweep_dir: Path, uri: str) -> None:
    """Refusals that save a multi-node sweep from failing late.

    On more than one node, every node must see the storage folder (a marker written here is looked for by a
    task pinned to each node), a SQLite MLflow store must be reachable by every node the same way, and some
    node must be able to hold one trial's resources (else Tune would pend forever, ray#19985).
    """
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    need = {"CPU": spec.resources.cpu, "GPU": spec.resources.gpu}
    if not any(all(n["Resources"].get(k, 0) >= v for k, v in need.items() if v > 0) for n in nodes):
        have = sorted({f"CPU={n['Resources'].get('CPU', 0):g}, GPU={n['Resources'].get('GPU', 0):g}"
                       for n in nodes})
        raise SpecError(f"resources: a trial asks for CPU={need['CPU']:g}, GPU={need['GPU']:g} but no node has "
                        f"that much (nodes: {'; '.join(have)})")
    if len(nodes) < 2:
        return
    checks = [("storage_path", sweep_dir)]
    if uri.startswith("sqlite:"):
        checks.append(("tracking.uri", Path(uri.removeprefix("sqlite:///")).parent))
    for field, folder in checks:
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".qed-reach-{uuid.uuid4().hex[:8]}"
        marker.write_text("x")
        try:
            blind = [n["NodeID"][:8] for n in nodes if not ray.get(_exists_on.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    n["NodeID"], soft=False)).remote(str(marker)))]
        finally:
            marker.unlink(missing_ok=True)
        if blind:
            raise SpecError(f"{field}: {folder} is local to the driver's node; nodes {', '.join(blind)} cannot "
                            f"reach it. Use a shared filesystem mounted at the same path on every node or, for "
                            f"MLflow, a tracking server (MLFLOW_TRACKING_URI=http://head:5000)")


@ray.remote(num_cpus=0)
def _exists_on(path: str) -> bool:
    return os.path.exists(path)


def print_summary(results: SweepResults | None, gathered: dict, failed: list[FailedTrial], uri: str,
                  experiment_id: str | None = None) -> None:
    """The closing table (counts, IQM, V and its baseline ratio with CIs), what the gather step did while the sweep
    ran, and every trial left out with its reason."""
    if results is not None:
        print("\n" + tables.format_table(results.aggregates, results.final_eval.confidence))
    if gathered:
        delays = sorted(gathered["delays_s"][g] for g in gathered["evaluated"] if g in gathered["delays_s"])
        timing = (f"; from a group's last trial to its row in MLflow: median {delays[len(delays) // 2]:.0f} s, "
                  f"longest {delays[-1]:.0f} s") if delays else ""
        print(f"\ngather: {len(gathered['evaluated'])} group(s) evaluated, {len(gathered['from_cache'])} taken from "
              f"the cache{timing}")
    for f in failed:
        print(f"FAILED {f.name}: {f.error}")
    print(f"\nMLflow: {ui_command(uri, experiment_id)}")


def run_sweep(spec: SweepSpec, spec_path: Path, fresh: bool = False) -> int:
    """Runs (or resumes) the sweep end to end; returns the exit code."""
    layout, uri, experiment = resolve_paths(spec)
    state = sweep_state(layout, spec, fresh)
    fresh_start = not any(layout.root.glob("experiment_state-*.json"))
    if not ray.is_initialized():
        quiet_opt_out_notice()  # auth stays on; only Ray's advice to switch it off is not printed
        with private_ray_token():  # Ray writes a new ~/.ray/auth_token with the umask (0644): keep it 0600
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    check_cluster(spec, layout.root, uri)
    tracker = Tracker(uri, experiment, state["sweep_id"], artifact_location=str(layout.mlartifacts))
    tracker.mark_training_experiment()  # also on an experiment a resumed sweep created with an older version
    parent = tracker.parent_run(spec.name, spec.model_dump(mode="json", exclude={"agents"}),
                                {"qed.spec_path": str(spec_path), "qed.git_sha": _git_sha()})
    tracker.log_artifact(parent, spec_path, "spec")
    context = TrialContext(sweep_id=state["sweep_id"], sweep_dir=layout.root, tracking_uri=uri,
                           experiment=experiment, parent_run_id=parent, keep_every=spec.final_eval.keep_every,
                           gpu_fraction=spec.resources.gpu)
    print(f"sweep {spec.name}: {len(spec.runs())} trials, results in {layout.root}", flush=True)
    gatherer = start_gather(spec, layout, state["sweep_id"], uri, experiment, parent)
    feed = gather.GatherFeed(gather.actor_name(spec.name, state["sweep_id"]))
    result_grid = build_tuner(spec, context, fresh_start, [feed]).fit()
    failed = failed_trials(result_grid)
    for f in failed:  # never leave a run RUNNING: a trial lost with its worker could not close its own
        tracker.close_failed_trial(f.name, f.error)
    results, gathered, gather_ok = None, {}, True
    try:
        gathered = gather.finish(gatherer, failed)
        results = gathered["results"]
        # Left out by the gather step itself (a refused snapshot, no recorded checksum): reported like failures.
        known = {f.name for f in failed}
        left_out = [f for f in results.failed_trials if f.name not in known]
        gather_ok = not left_out
        failed += left_out
    except Exception as e:  # noqa: BLE001 - report, log what finished, exit non-zero
        failed.append(FailedTrial("gather", f"{type(e).__name__}: {e}"))
        gather_ok = False
    tracker.end_run(parent, failed_reason="; ".join(f"{f.name}: {f.error}" for f in failed) or None)
    print_summary(results, gathered, failed, uri, tracker.experiment_id)
    return 0 if gather_ok and not failed else 1


def start_gather(spec: SweepSpec, layout: SweepDir, sweep_id: str, uri: str, experiment: str, parent: str):
    """Starts the sweep's gather actor for the whole sweep, handing it the trials that are already done."""
    names = [t.name for t in spec.trials()]
    resources, in_flight = gather.group_task_resources(
        [n for n in ray.nodes() if n.get("Alive")], spec.resources.cpu, spec.resources.gpu, len(names),
        spec.max_concurrent_trials)
    plan = gather.GatherPlan(spec.name, sweep_id, str(layout.root), spec.final_eval, plan_groups(names), uri,
                             experiment, parent, resources, in_flight)
    return gather.start(plan, [n for n in names if layout.done_marker(n).exists()])


def _git_sha() -> str:
    try:
        import subprocess

        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m qed_ray.sweep", description=__doc__.splitlines()[0])
    p.add_argument("spec", type=Path, help="sweep YAML (see sweeps/ and the README's field table)")
    p.add_argument("--dry-run", action="store_true", help="print the expanded trials and resources, run nothing")
    p.add_argument("--fresh", action="store_true", help="start a new sweep (the old folder is moved aside)")
    p.add_argument("--status", action="store_true", help="print the sweep's progress and partial results from its "
                   "folder; starts nothing")
    args = p.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0 the legacy reporter prints no tables
    # Snapshots forced by num_to_keep are what make a restore precise; their warning is noise here.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    try:
        spec = load_spec(args.spec)
        if args.dry_run:
            return dry_run(spec)
        if args.status:
            print(status.report(spec, resolve_paths(spec)[0]))
            return 0
        return run_sweep(spec, args.spec.resolve(), args.fresh)
    except SpecError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
