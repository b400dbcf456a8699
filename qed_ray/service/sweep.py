"""The sweep driver: every trial of a spec as a Ray Tune trial over a fresh Tuner per start, a gather actor for the
cross-seed metrics, everything mirrored to MLflow (docs/design.md: the data flow, resume, packs, exit codes)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import ray
from ray import tune

from qed_ray.spec import console
from qed_ray.service import announce, gather
from qed_ray.analysis import report
from qed_ray.service.cluster import check_cluster
from qed_ray.service.plan.dry_plan import order_packs
from qed_ray.records.layout import SweepDir
from qed_ray.service.lock import SweepLock
from qed_ray.service.results_key import ResultsKey
from qed_ray.service.reanalysis import refuse_unverified
from qed_ray.analysis.results import FailedTrial, SweepResults
from qed_ray.spec.sweep import SweepSpec
from qed_ray.service.status import error_summary
from qed_ray.records.codec import RecordError
from qed_ray.records.file_reads import cut, read_tail
from qed_ray.service.packing import Pack, TuneTrial
from qed_ray.records.sweep import SweepState
from qed_ray.records.throughput import load_throughput
from qed_ray.service.sweep_state import git_sha, outcome, prune_finished, sync_runs
from qed_ray.service.mlflow.mlflow_view import ui_command
from qed_ray.service.mlflow.tracking import Tracker, artifact_location
from qed_ray.service.trial import TrialContext, train_trial

EXIT_LOST = 3  # the driver lost the sweep's lock


def trial_name(trial) -> str:
    return TuneTrial.of(trial.config).name


def tune_dirname(trial) -> str:
    return TuneTrial.of(trial.config).id.dirname


class Interrupt(tune.Stopper):
    """Ctrl-C (SIGINT), ``ray job stop`` (SIGTERM) or a lost lock (``lost``): stop every trial cleanly; a second
    signal exits at once. Tune's own SIGINT handler is disabled (``TUNE_DISABLE_SIGINT_HANDLER``)."""

    def __init__(self, lost: threading.Event | None = None):
        self.signum: int | None = None
        self.lost = lost or threading.Event()

    def install(self) -> None:
        """After ``ray.init``, which sets its own SIGTERM handler. A signal the previous start's stopper took after
        its trials had ended (an adaptive sweep between looks) carries over: this start then trains nothing."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            before = signal.signal(sig, self._handle)  # read after the swap: no signal falls between the two
            taken = getattr(getattr(before, "__self__", None), "signum", None)
            self.signum = self.signum if self.signum is not None else taken

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping the trials (checkpoints are kept; run the same command "
              f"to resume). Press Ctrl-C again to exit at once.", flush=True)

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False

    def stop_all(self) -> bool:
        return self.signum is not None or self.lost.is_set()

    def __reduce__(self):  # Tune pickles its stopper into tuner.pkl (never read back here): an Event cannot go
        return Interrupt, ()


class Progress(tune.Callback):
    """A concise progress view (instead of Tune's tables) that also records trials Tune gave up on."""

    def __init__(self, total_env_steps: int, interrupt: Interrupt | None = None, every_s: float = 15.0,
                 resumed: dict[str, int] | None = None):
        self.total, self.interrupt, self.every_s = total_env_steps, interrupt, every_s
        self.resumed = resumed or {}  # pack -> env steps its checkpoint holds: counted before it reports again
        self.t0 = time.time()
        self.last = 0.0
        self.start_steps: int | None = None
        self.failed: dict[str, str] = {}  # trial -> last line of its error, once it has no retries left

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        now = time.time()
        if now - self.last >= self.every_s:
            self.last = now
            print(self.line(trials), flush=True)

    def on_trial_recover(self, iteration: int, trials: list, trial, **info) -> None:
        print(f"  trial {trial_name(trial)} failed; retrying from its last checkpoint", flush=True)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        try:
            self.failed[trial_name(trial)] = error_summary(read_tail(trial.error_file, RecordError)) \
                if trial.error_file and os.path.lexists(trial.error_file) else error_summary("")
        except RecordError as e:
            self.failed[trial_name(trial)] = cut(str(e))
        print(f"  trial {trial_name(trial)} failed and has no retries left", flush=True)

    def on_experiment_end(self, trials: list, **info) -> None:
        if not self.stopped:
            print(self.line(trials), flush=True)

    @property
    def stopped(self) -> bool:
        """Tune then reports the stopped trials as done."""
        return self.interrupt is not None and self.interrupt.stop_all()

    def line(self, trials: list) -> str:
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.status] = counts.get(t.status, 0) + 1
        steps = sum(max(int((t.last_result or {}).get("seed_env_steps", 0)), self.resumed.get(trial_name(t), 0))
                    for t in trials)  # a pack's seeds together, from its checkpoint on
        if self.start_steps is None:
            self.start_steps = steps
        rate = (steps - self.start_steps) / max(time.time() - self.t0, 1e-9)
        eta = f"{(self.total - steps) / rate / 60:.1f} min" if rate > 0 else "-"
        return (f"[{time.strftime('%H:%M:%S')}] trials: {counts.get('TERMINATED', 0)}/{len(trials)} done, "
                f"{counts.get('RUNNING', 0)} running, {counts.get('PENDING', 0)} pending, "
                f"{counts.get('ERROR', 0)} failed | env steps {steps:,}/{self.total:,} "
                f"({100 * steps / max(self.total, 1):.0f}%) | ETA {eta}")


class NeverStarted(logging.Filter):
    """Drops Tune's "Failed to fetch metrics for N trial(s)" when each of them failed for want of a result file (the
    trials a Ctrl-C stopped before they reported: outcomes come from the sweep folder, never from Tune's metrics)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith("Failed to fetch metrics for "):
            return True
        return not all("FileNotFoundError" in line for line in text.splitlines()[1:])


def quiet_never_started() -> None:
    logger = logging.getLogger("ray.tune.analysis.experiment_analysis")
    if not any(isinstance(f, NeverStarted) for f in logger.filters):
        logger.addFilter(NeverStarted())


def build_tuner(spec: SweepSpec, context: TrialContext, packs: list[Pack], start: str,
                callbacks: list, stopper: tune.Stopper) -> tune.Tuner:
    """A fresh Tuner over ``packs`` (one Tune trial each) in ``tune/<start>/`` (logs only). With ``reuse_actors`` a
    reused worker trains as a fresh one does: a trial builds everything from its config and context, and its
    trainer makes the process-wide settings (torch threads, matrix-product precision) again."""
    trainable = tune.with_resources(tune.with_parameters(train_trial, context=context), spec.trial_resources())
    space = {"pack": tune.grid_search([TuneTrial.from_pack(p).param() for p in packs])}
    return tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(trial_name_creator=trial_name, trial_dirname_creator=tune_dirname,
                                    max_concurrent_trials=spec.max_concurrent_trials, reuse_actors=True),
        run_config=tune.RunConfig(name=start, storage_path=str(context.layout.tune_root), verbose=0, stop=stopper,
                                  failure_config=tune.FailureConfig(max_failures=spec.max_retries),
                                  callbacks=callbacks))


def train_pending(spec: SweepSpec, context: TrialContext, interrupt: Interrupt, callbacks: list,
                  packs: list[Pack]) -> dict[str, str]:
    """Trains the packs with a pending seed run until none is, or Tune gave up on it; returns ``{trial: error}`` of
    the latter's pending seed runs. A worker killed from outside (Ray's memory monitor) ends ``fit()`` in Tune 2.60:
    the packs start again from their checkpoints until ``max_retries`` restarts in a row make no new checkpoint."""
    layout, stamp = context.layout, time.strftime("%Y%m%d-%H%M%S")
    failed: dict[str, str] = {}
    streak, mark = 0, _progress_mark(layout, packs)
    for attempt in range(10**6):
        pending = [p for p in packs if p.name not in failed
                   and any(layout.trial_state(n) == "pending" for n in p.names)]
        if not pending or interrupt.stop_all():
            break
        progress = Progress(sum(p.env_steps for p in pending), interrupt,
                            resumed=announce.resumed_env_steps(layout, pending))
        try:
            build_tuner(spec, context, pending, f"{stamp}-{attempt}", [progress, *callbacks], interrupt).fit()
            failed.update(progress.failed)
            break
        except Exception as e:  # noqa: BLE001 - a failed start is reported with the summary, never a traceback
            failed.update(progress.failed)
            if not isinstance(e, RuntimeError) or not isinstance(e.__cause__, ray.exceptions.RayError):
                why = f"this start failed in Tune ({type(e).__name__}: {cut(str(e))}); the same command resumes it"
                print(f"error: {why}", file=sys.stderr, flush=True)  # a full disk, say (L12)
                failed.update({p.name: why for p in pending if p.name not in failed})
                break
            now = _progress_mark(layout, packs)
            streak, mark = (0 if now > mark else streak + 1), max(now, mark)
            cause = " ".join(str(e.__cause__).split())[:300]
            if streak > spec.max_retries:
                print(f"a trial worker was killed from outside {streak} times without progress ({cause}); "
                      f"leaving the unfinished trials for the next start", flush=True)
                break
            print(f"a trial worker was killed from outside ({type(e.__cause__).__name__}: {cause}); restarting "
                  f"the unfinished trials from their checkpoints", flush=True)
    return {n: failed[p.name] for p in packs if p.name in failed for n in p.names
            if layout.trial_state(n) == "pending"}


def _progress_mark(layout: SweepDir, packs: list[Pack]) -> int:
    return sum(max(layout.pack_checkpoint_steps(p.id), default=0) for p in packs)


def print_summary(results: SweepResults | None, gathered: gather.GatherReport | None, failed: list[FailedTrial],
                  uri: str, experiment_id: str | None = None, layout: SweepDir | None = None,
                  sweep_id: str | None = None) -> None:
    """The closing summary and verdict, what the gather step did while the sweep ran, and every trial left out."""
    if results is not None:
        print("\n" + report.summary(results, layout, console.width()))
    if gathered is not None:
        delays = sorted(gathered.delays_s[g] for g in gathered.evaluated if g in gathered.delays_s)
        timing = (f"; from a group's last trial to its row in MLflow: median {delays[len(delays) // 2]:.0f} s, "
                  f"longest {delays[-1]:.0f} s") if delays else ""
        print(f"\ngather: {len(gathered.evaluated)} group(s) evaluated, {len(gathered.from_cache)} taken from "
              f"the cache{timing}")
    for f in failed:
        print(f"FAILED {f.name}: {cut(f.error)}")
    print(f"\nMLflow: {ui_command(uri, experiment_id, sweep_id)}")


def run_locked(spec: SweepSpec, spec_path: Path, layout: SweepDir, uri: str, experiment: str, state: SweepState,
               new: list[str], gather_partial: bool, packs: list[Pack], lock: SweepLock, key: ResultsKey,
               allow_unverified: bool = False) -> int:
    prune_finished(layout, packs, spec.keep_replay)
    interrupt = Interrupt(lock.lost)
    interrupt.install()
    quiet_never_started()
    check_cluster(spec, layout.root, uri)
    packs = order_packs(spec, packs, load_throughput())  # longest first on GPUs, once the cluster can take them
    tracker = Tracker(uri, experiment, state.sweep_id, artifact_location=artifact_location(uri, layout))
    tracker.mark_training_experiment()  # also on an experiment a resumed sweep created with an older version
    parent = tracker.parent_run(spec.name, spec.model_dump(mode="json", exclude={"agents"}),
                                {"qed.spec_path": str(spec_path), "qed.git_sha": git_sha()})
    tracker.log_artifact(parent, spec_path, "spec")
    tracker.share_group_view(parent)  # the address printed at the end opens it
    context = TrialContext(sweep_id=state.sweep_id, sweep_dir=layout.root, tracking_uri=uri,
                           experiment=experiment, parent_run_id=parent, keep_every=spec.final_eval.keep_every,
                           gpu_fraction=spec.resources.gpu, keep_replay=spec.keep_replay,
                           env_workers=spec.pack.env_workers, results_key=key.secret.hex(), lock_token=lock.info.token)
    print(announce.start_line(spec, layout, packs, new), flush=True)
    # MLflow in line with the folder before the gather step reads it (runs an earlier start could not end).
    sync_runs(tracker, parent, layout, spec, *outcome(layout, spec, {}), packs=packs)
    claim = state.claim.model_dump() if state.claim is not None else None
    launch = lambda: gather.launch(spec, layout, state.sweep_id, uri, experiment, parent,  # noqa: E731
                                   key.secret, len(packs), claim)
    gatherer = launch()
    feed = gather.GatherFeed(gather.actor_name(spec.name, state.sweep_id))
    failed = train_pending(spec, context, interrupt, [feed], packs)
    if lock.lost.is_set() or not lock.beat():  # another driver runs the sweep now: leave its folder and runs alone
        gather.stop(gatherer)
        return EXIT_LOST
    prune_finished(layout, packs, spec.keep_replay)
    failures, unfinished = outcome(layout, spec, failed)
    # A trial whose files are damaged is reported with the failures.
    damaged = sync_runs(tracker, parent, layout, spec, failures, unfinished, packs=packs)
    failures += [f for f in damaged if f.name not in {g.name for g in failures}]
    if interrupt.signum is not None and not gather_partial:
        gather.stop(gatherer)
        _best_effort(tracker.end_run, parent, killed=True)
        print(f"stopped: {len(spec.trials()) - len(unfinished) - len(failures)} trials finished, {len(unfinished)} "
              f"unfinished (resumed by the same command); nothing gathered at the stop (groups complete before it "
              f"stay gathered; --gather-partial gathers what finished)", flush=True)
        return 128 + interrupt.signum
    return _finish(tracker, parent, gatherer, launch, failures, unfinished, interrupt.signum, uri, layout,
                   allow_unverified, feed)


def _finish(tracker: Tracker, parent: str, gatherer, launch, failures: list[FailedTrial], unfinished: list[str],
            signum: int | None, uri: str, layout: SweepDir, allow_unverified: bool = False,
            feed: gather.GatherFeed | None = None) -> int:
    """The final gather, the parent run's end, the summary; returns the exit code. A gather actor that died
    meanwhile (killed with its node's memory) is started again: the groups it gathered are in the cache."""
    why = ("stopped before it finished; the same command resumes it" if signum is not None else
           "unfinished (its worker kept being killed); run the sweep again to resume it")
    failures = failures + [FailedTrial(n, why) for n in unfinished]
    results, gathered, gather_ok = None, None, True
    try:
        try:
            gathered = gather.finish(gatherer, failures)
        except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as e:
            # Ray's memory monitor may take the gather actor along with a trial worker (it kills several workers
            # at once); a call on an actor it killed raises OutOfMemoryError rather than RayActorError.
            print(f"the gather actor died ({type(e).__name__}); gathering again from the cache", flush=True)
            gathered = gather.finish(launch(), failures)
        results = gathered.results
        if feed is not None:  # the groups that landed since the feed last asked
            feed.print_lines(gathered.lines[feed.printed:])
        # Left out by the gather step itself (a file or cache entry that failed its check): reported like failures.
        known = {f.name for f in failures}
        left_out = [f for f in results.failed_trials if f.name not in known]
        gather_ok = not left_out
        failures += left_out
    except Exception as e:  # noqa: BLE001 - report, log what finished, exit non-zero
        failures.append(FailedTrial("gather", f"{type(e).__name__}: {e}"))
        gather_ok = False
    reason = "; ".join(f"{f.name}: {f.error}" for f in failures) or None
    _best_effort(tracker.end_run, parent, failed_reason=None if signum is not None else reason,
                 killed=signum is not None)
    print_summary(results, gathered, [f for f in failures if signum is None or f.name not in unfinished], uri,
                  tracker.experiment_id, layout, tracker.sweep_id)
    if signum is not None:
        return 128 + signum
    unverified = refuse_unverified(results, allow_unverified)
    return 0 if gather_ok and not failures and not unverified else 1


def _best_effort(call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the results are in the sweep folder either way
        print(f"WARNING: MLflow failed at the end of the sweep ({type(e).__name__}: {e}); the results are in the "
              f"sweep folder", flush=True)
