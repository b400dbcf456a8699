"""The sweep service: ``python -m qed_ray.sweep SPEC`` (or ``ray job submit -- python -m qed_ray.sweep SPEC``).

Joins the Ray cluster it finds (``RAY_ADDRESS`` / a running ``ray start``) or starts an embedded one, runs every
trial of the spec as a Ray Tune trial (resuming the same sweep when run again), gathers the finished policies in
a named actor for the cross-seed metrics, and logs everything to MLflow (one parent run per sweep, one child run
per trial). Exit code 0 only when every trial finished and gathering succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import ray
from ray import tune

from qed_ray import gather as gather_mod
from qed_ray.analysis import TrialRecord
from qed_ray.config import RunSpec
from qed_ray.ray_token import private_ray_token
from qed_ray.spec import SpecError, SweepSpec, load_spec
from qed_ray.tracking import Tracker, default_tracking_uri, ui_command
from qed_ray.train import build_trainer

STATE_FILE = "sweep.json"
DONE_FILE = "DONE.json"  # written beside a trial's final policy snapshot when it has finished


def trial_dirname(spec: RunSpec) -> str:
    """Folder-safe trial name: ``task__agent__variant__sSEED``."""
    return f"{spec.task}__{spec.agent.name}__{spec.variant}__s{spec.seed}"


# ---- the trainable (runs in a Ray worker) ----------------------------------------------------------------
class TuneReporter:
    """Persists each evaluation as a Tune checkpoint, keeps policy snapshots, then logs metrics to MLflow."""

    def __init__(self, spec: RunSpec, ctx: dict, tracker: Tracker, run_id: str):
        self.spec, self.ctx, self.tracker, self.run_id = spec, ctx, tracker, run_id
        self.policy_root = Path(ctx["sweep_dir"]) / "policies" / trial_dirname(spec)
        # Steps already in MLflow (a restore can replay an interval whose metrics were logged): never log twice.
        self.logged_up_to = tracker.last_step(run_id, "eval/return_mean")

    def __call__(self, metrics: dict, save) -> None:
        step = int(metrics["env_steps"])
        n_eval = step // self.spec.train.eval_every
        if n_eval % self.ctx["keep_every"] == 0 or step == self.spec.train.env_steps:
            save(self.policy_root / f"{step:010d}", policy_only=True)
        with tempfile.TemporaryDirectory() as d:
            save(Path(d))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))  # copied synchronously
        # MLflow after the checkpoint is durable: a crash in between re-logs this step, never skips one.
        if step > self.logged_up_to:
            self.tracker.log_metrics(self.run_id, metrics, step)
        if step == self.spec.train.env_steps:
            tmp = self.policy_root / (DONE_FILE + ".tmp")
            tmp.write_text(json.dumps(metrics))
            os.replace(tmp, self.policy_root / DONE_FILE)


def train_trial(config: dict) -> None:
    """Tune function trainable; the Ray boundary is crossed once, here (config -> RunSpec)."""
    spec = RunSpec.model_validate(config["run"])
    ctx = config["context"]
    tracker = Tracker(ctx["tracking_uri"], ctx["experiment"], ctx["sweep_id"])
    run_id = tracker.trial_run(ctx["parent_run_id"], spec.name, spec.model_dump(mode="json"))
    _record_node(tracker, run_id)
    replay_dir = Path(ctx["sweep_dir"]) / "replay" / trial_dirname(spec)
    _limit_gpu_memory(ctx["gpu_fraction"])
    # Progress and warnings go to the worker's log (Ray keeps it per worker; the driver shows a summary view).
    trainer = build_trainer(spec, TuneReporter(spec, ctx, tracker, run_id), replay_dir,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    checkpoint = tune.get_checkpoint()
    done = Path(ctx["sweep_dir"]) / "policies" / trial_dirname(spec) / DONE_FILE
    if done.exists():
        # Finished before the driver died, but Tune's state did not record it: report, never re-train.
        tune.report(json.loads(done.read_text()))
        tracker.end_run(run_id)
        return
    try:
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                trainer.restore(Path(d))
            tracker.set_tags(run_id, {"qed.resumed_from_env_step": trainer.resumed_from})
        summary = trainer.run()
        tracker.set_tags(run_id, {"qed.status": summary["status"]})
        tracker.end_run(run_id)
    except BaseException as e:  # noqa: BLE001 - record any failure, then let Tune retry or mark the trial errored
        tracker.end_run(run_id, failed_reason=f"{type(e).__name__}: {e}")
        raise


def _limit_gpu_memory(fraction: float) -> None:
    """Fractional GPUs are a scheduling fiction (no isolation): cap this trial's share of GPU memory."""
    import torch

    if 0 < fraction < 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)


def _record_node(tracker: Tracker, run_id: str) -> None:
    """Appends this worker's Ray node id to the run's ``qed.node_ids`` tag (where each attempt ran)."""
    node = ray.get_runtime_context().get_node_id()
    seen = tracker.tags(run_id).get("qed.node_ids", "")
    tracker.set_tags(run_id, {"qed.node_ids": ",".join(filter(None, [seen, node]))})


# ---- driver --------------------------------------------------------------------------------------------
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
        print(f"  trial {RunSpec.model_validate(trial.config['run']).name} failed; retrying from its last "
              f"checkpoint", flush=True)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        print(f"  trial {RunSpec.model_validate(trial.config['run']).name} failed and has no retries left",
              flush=True)

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


def resolve_paths(spec: SweepSpec, spec_path: Path) -> tuple[Path, str, str]:
    """Absolute sweep folder, tracking URI and experiment (env vars override the spec's storage and URI)."""
    raw = os.environ.get("QED_STORAGE_PATH") or spec.storage_path
    if "://" in raw:
        # Policy snapshots, replay chunks and DONE markers are plain files read by every node; object stores
        # would need a filesystem layer this version does not have.
        field = "QED_STORAGE_PATH" if os.environ.get("QED_STORAGE_PATH") else "storage_path"
        raise SpecError(f"{field}: {raw!r} is a URI; give a filesystem path (on a cluster: a shared mount such as "
                        f"EFS/NFS, Filestore or a ReadWriteMany volume, mounted at the same path on every node)")
    storage = Path(raw).expanduser().resolve()
    sweep_dir = storage / spec.name
    uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.tracking.uri or default_tracking_uri(sweep_dir)
    return sweep_dir, uri, spec.tracking.experiment or spec.name


def sweep_state(sweep_dir: Path, spec: SweepSpec, fresh: bool) -> dict:
    """Reads or creates ``sweep.json`` (the sweep's stable id); refuses a changed grid without ``--fresh``."""
    path = sweep_dir / STATE_FILE
    if path.exists() and fresh:
        backup = sweep_dir.with_name(f"{sweep_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(sweep_dir), backup)
        print(f"--fresh: moved the previous sweep to {backup}")
    if path.exists():
        state = json.loads(path.read_text())
        if state["fingerprint"] != spec.fingerprint():
            raise SpecError(f"{sweep_dir}: the spec's grid changed since this sweep started; run with --fresh "
                            f"(the old sweep is kept aside) or change 'name'")
        return state
    sweep_dir.mkdir(parents=True, exist_ok=True)
    state = {"sweep_id": uuid.uuid4().hex[:12], "fingerprint": spec.fingerprint(), "created": time.time()}
    path.write_text(json.dumps(state))
    return state


def dry_run(spec: SweepSpec, spec_path: Path) -> int:
    """Prints the expanded trial list and the resources it needs; starts nothing."""
    runs = spec.runs()
    sweep_dir, uri, exp = resolve_paths(spec, spec_path)
    print(f"sweep {spec.name}: {len(runs)} trials -> {sweep_dir}  (MLflow {uri}, experiment {exp})")
    for r in runs:
        print(f"  {r.name:48s} env_steps={r.train.env_steps:,} hidden={r.agent.hidden} batch={r.agent.batch_size}")
    res = spec.resources
    total = sum(r.train.env_steps for r in runs)
    print(f"per trial: {res.cpu:g} CPU, {res.gpu:g} GPU; all trials at once: {res.cpu * len(runs):g} CPU, "
          f"{res.gpu * len(runs):g} GPU; total env steps {total:,}")
    return 0


def build_tuner(spec: SweepSpec, sweep_dir: Path, ctx: dict, fresh_start: bool):
    """A new Tuner over the grid, or the restored one when this sweep already has experiment state."""
    res = {"cpu": spec.resources.cpu, "gpu": spec.resources.gpu}
    trainable = tune.with_resources(train_trial, res)
    if not fresh_start and tune.Tuner.can_restore(str(sweep_dir)):
        print(f"resuming sweep from {sweep_dir}", flush=True)
        return tune.Tuner.restore(str(sweep_dir), trainable, resume_unfinished=True, resume_errored=True)
    runs = spec.runs()
    param_space = {"run": tune.grid_search([r.model_dump(mode="json") for r in runs]), "context": ctx}
    name_of = lambda t: RunSpec.model_validate(t.config["run"]).name  # noqa: E731
    dir_of = lambda t: trial_dirname(RunSpec.model_validate(t.config["run"]))  # noqa: E731
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(trial_name_creator=name_of, trial_dirname_creator=dir_of,
                                    max_concurrent_trials=spec.max_concurrent_trials),
        run_config=tune.RunConfig(
            name=sweep_dir.name, storage_path=str(sweep_dir.parent), verbose=0,
            failure_config=tune.FailureConfig(max_failures=spec.max_retries),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),
            callbacks=[Progress(sum(r.train.env_steps for r in runs))]))


def trial_records(result_grid, sweep_dir: Path) -> tuple[list[TrialRecord], list[dict]]:
    """Finished trials as gather records; failed ones as ``{name, error}``."""
    records, failed = [], []
    for result in result_grid:
        spec = RunSpec.model_validate(result.config["run"])
        if result.error is not None:
            first = str(result.error).strip().splitlines()
            failed.append({"name": spec.name, "error": first[-1] if first else type(result.error).__name__})
            continue
        root = sweep_dir / "policies" / trial_dirname(spec)
        policies = {int(p.name): str(p) for p in sorted(root.iterdir()) if (p / "manifest.json").exists()} \
            if root.exists() else {}
        if spec.train.env_steps not in policies:
            failed.append({"name": spec.name, "error": "finished without a final policy snapshot"})
            continue
        df = result.metrics_dataframe
        cols = [c for c in ("env_steps", "eval/return_mean", "q/abs_diff_mean") if df is not None and c in df]
        history = df[cols].to_dict("records") if cols else []
        records.append(TrialRecord(spec.name, spec.task, spec.agent.name, spec.variant, spec.seed,
                                   spec.train.frame_skip, policies, history))
    return records, failed


def check_cluster(spec: SweepSpec, sweep_dir: Path, uri: str) -> None:
    """Refusals that save a multi-node sweep from failing late (issue: cluster-aware driver).

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


def print_summary(results: dict, failed: list[dict], uri: str) -> None:
    """The closing table: per agent-variant IQM [95% CI], CI width, V mean/median, action distance."""
    print(f"\n{'agent':8s} {'variant':9s} {'tasks':>5s} {'seeds':>5s} {'IQM':>6s} {'95% CI':>15s} {'width':>6s} "
          f"{'V mean':>9s} {'V median':>9s} {'act.dist':>9s}")
    fmt = lambda v, p=3: "nan" if v is None else f"{v:.{p}g}"  # noqa: E731
    for a in results["aggregates"]:
        ci = f"[{fmt(a['ci_lower'])}, {fmt(a['ci_upper'])}]"
        print(f"{a['agent']:8s} {a['variant']:9s} {a['n_tasks']:5d} {a['n_seeds']:5d} {fmt(a['iqm']):>6s} "
              f"{ci:>15s} {fmt(a['ci_width']):>6s} {fmt(a['V_mean']):>9s} {fmt(a['V_median']):>9s} "
              f"{fmt(a['action_distance_mean']):>9s}")
    for f in failed:
        print(f"FAILED {f['name']}: {f['error']}")
    print(f"\nMLflow: {ui_command(uri)}")


def run_sweep(spec: SweepSpec, spec_path: Path, fresh: bool = False) -> int:
    """Runs (or resumes) the sweep end to end; returns the exit code."""
    sweep_dir, uri, experiment = resolve_paths(spec, spec_path)
    state = sweep_state(sweep_dir, spec, fresh)
    fresh_start = not any(sweep_dir.glob("experiment_state-*.json"))
    if not ray.is_initialized():
        with private_ray_token():  # Ray writes a new ~/.ray/auth_token with the umask (0644): keep it 0600
            ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    check_cluster(spec, sweep_dir, uri)
    tracker = Tracker(uri, experiment, state["sweep_id"], artifact_location=str(sweep_dir / "mlartifacts"))
    parent = tracker.parent_run(spec.name, spec.model_dump(mode="json", exclude={"agents"}),
                                {"qed.spec_path": str(spec_path), "qed.git_sha": _git_sha()})
    tracker.log_artifact(parent, spec_path, "spec")
    ctx = {"sweep_id": state["sweep_id"], "sweep_dir": str(sweep_dir), "tracking_uri": uri,
           "experiment": experiment, "parent_run_id": parent, "keep_every": spec.final_eval.keep_every,
           "gpu_fraction": spec.resources.gpu}
    print(f"sweep {spec.name}: {len(spec.runs())} trials, results in {sweep_dir}", flush=True)
    result_grid = build_tuner(spec, sweep_dir, ctx, fresh_start).fit()
    records, failed = trial_records(result_grid, sweep_dir)
    for f in failed:  # never leave a run RUNNING: a trial lost with its worker could not close its own
        tracker.close_failed_trial(f["name"], f["error"])
    results = {"aggregates": []}
    gather_ok = False
    try:
        results = gather_mod.gather(spec.name, state["sweep_id"], records, spec.final_eval.model_dump(),
                                    sweep_dir / "gather", failed)
        gather_ok = True
    except Exception as e:  # noqa: BLE001 - report, log what finished, exit non-zero
        failed.append({"name": "gather", "error": f"{type(e).__name__}: {e}"})
    _log_parent(tracker, parent, results, sweep_dir, failed)
    print_summary(results, failed, uri)
    return 0 if gather_ok and not failed else 1


def _log_parent(tracker: Tracker, parent: str, results: dict, sweep_dir: Path, failed: list[dict]) -> None:
    for a in results["aggregates"]:
        key = f"{a['agent']}.{a['variant']}"
        tracker.log_metrics(parent, {f"{key}/{m}": a[m] for m in ("iqm", "ci_lower", "ci_upper", "ci_width",
                                                                  "V_mean", "V_median", "action_distance_mean")
                                     if a[m] is not None}, step=0)
    if (sweep_dir / "gather").exists():
        tracker.log_artifacts(parent, sweep_dir / "gather", "gather")
    tracker.end_run(parent, failed_reason="; ".join(f"{f['name']}: {f['error']}" for f in failed) or None)


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
    args = p.parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0 the legacy reporter prints no tables
    # Snapshots forced by num_to_keep are what make a restore precise; their warning is noise here.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    try:
        spec = load_spec(args.spec)
        if args.dry_run:
            return dry_run(spec, args.spec)
        return run_sweep(spec, args.spec.resolve(), args.fresh)
    except SpecError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
