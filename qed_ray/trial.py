"""The worker side of a sweep trial: what runs inside a Ray Tune worker.

The driver (``sweep.py``) hands every trial a frozen :class:`TrialContext` through ``tune.with_parameters``, so
the context is given again by the driver on every start (and never pickled into Tune's experiment state), and
the trial's own config ``{"trial": {"name", "run"}}`` through Tune's param space. :func:`train_trial` validates
it once, builds the run with :func:`~qed_ray.trainer.build_trainer` and reports each evaluation through
:class:`TuneReporter`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import ray
from pydantic import Field
from ray import tune

from qed_ray.checksums import recorded_values
from qed_ray.config import Frozen, RunSpec, TrainSpec
from qed_ray.layout import SweepDir
from qed_ray.tracking import POLICY_SHA_TAG, Tracker
from qed_ray.trainer import SaveFn, build_trainer


class TrialContext(Frozen):
    """What every trial of a sweep shares, set by the driver (the same on every start of a trial)."""

    sweep_id: str = Field(min_length=1, description="the sweep's stable id (sweep.json)")
    sweep_dir: Path = Field(strict=False, description="absolute sweep folder (a shared mount on a cluster)")
    tracking_uri: str = Field(min_length=1, description="MLflow tracking URI reachable from every node")
    experiment: str = Field(min_length=1, description="MLflow experiment")
    parent_run_id: str = Field(min_length=1, description="the sweep's MLflow parent run")
    keep_every: int = Field(1, ge=1, description="keep a policy snapshot every n-th evaluation (and the last)")
    gpu_fraction: float = Field(0.0, ge=0, le=1, description="this trial's GPU share (caps its GPU memory)")

    @property
    def layout(self) -> SweepDir:
        """The sweep folder."""
        return SweepDir(self.sweep_dir)


def snapshot_modules(env_steps: int, train: TrainSpec, keep_every: int, acting: tuple[str, ...],
                     every: tuple[str, ...]) -> tuple[str, ...] | None:
    """Modules of the policy snapshot kept at the evaluation at ``env_steps``; None: this evaluation keeps none.

    Every ``keep_every``-th evaluation keeps the ``acting`` modules, enough to act and to compare seeds (V over
    training, paper App. E); the final one keeps ``every`` module, since the critic-proxy analysis reads the final
    critics (paper App. D).
    """
    if env_steps >= train.env_steps:
        return every
    if (env_steps // train.eval_every) % keep_every == 0:
        return acting  # MAD-SAC: ~1 MB instead of 18 MB per snapshot
    return None


class TuneReporter:
    """Persists each evaluation as a Tune checkpoint, keeps policy snapshots, then logs metrics to MLflow.

    Args:
        spec: the trial's run.
        context: the sweep's context.
        tracker: MLflow access; ``run_id`` is the trial's child run.
        acting_modules, all_modules: the agent's module names (see :func:`snapshot_modules`).
    """

    def __init__(self, name: str, spec: RunSpec, context: TrialContext, tracker: Tracker, run_id: str,
                 acting_modules: tuple[str, ...], all_modules: tuple[str, ...]):
        self.name, self.spec, self.context, self.tracker, self.run_id = name, spec, context, tracker, run_id
        self.acting_modules, self.all_modules = tuple(acting_modules), tuple(all_modules)
        # Steps already in MLflow (a restore can replay an interval whose metrics were logged): never log twice.
        self.logged_up_to = tracker.last_step(run_id, "eval/return_mean")

    def __call__(self, metrics: dict, save: SaveFn) -> None:
        step = int(metrics["env_steps"])
        layout, name = self.context.layout, self.name
        modules = snapshot_modules(step, self.spec.train, self.context.keep_every, self.acting_modules,
                                   self.all_modules)
        if modules is not None:
            save(layout.snapshot(name, step), modules=modules)
        with tempfile.TemporaryDirectory() as d:
            save(Path(d))
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))  # copied synchronously
        # MLflow after the checkpoint is durable: a crash in between re-logs this step, never skips one.
        if step > self.logged_up_to:
            self.tracker.log_metrics(self.run_id, metrics, step)
        if step == self.spec.train.env_steps:
            done = layout.done_marker(name)
            tmp = done.with_name(done.name + ".tmp")
            tmp.write_text(json.dumps(metrics))
            os.replace(tmp, done)


def train_trial(config: dict, context: TrialContext) -> None:
    """Tune function trainable; the Ray boundary is crossed once, here (config -> RunSpec).

    Args:
        config: this trial's Tune config, ``{"trial": {"name": trial name, "run": RunSpec dump}}``.
        context: the sweep's context (bound by the driver with ``tune.with_parameters``).
    """
    spec, name = RunSpec.model_validate(config["trial"]["run"]), config["trial"]["name"]
    layout = context.layout
    tracker = Tracker(context.tracking_uri, context.experiment, context.sweep_id)
    run_id = tracker.trial_run(context.parent_run_id, name, spec.model_dump(mode="json"))
    _record_node(tracker, run_id)
    done = layout.done_marker(name)
    if done.exists():
        # Finished before the driver died, but Tune's state did not record it: report, never re-train.
        if POLICY_SHA_TAG not in tracker.tags(run_id):  # it died before recording its checksums
            tracker.record_checksums(run_id, recorded_values(layout, name))
        tune.report(json.loads(done.read_text()))
        tracker.end_run(run_id)
        return
    _limit_gpu_memory(context.gpu_fraction)
    # The reporter needs the agent's module names, so it is made right after the trainer that builds the agent.
    trainer = build_trainer(spec, lambda metrics, save: reporter(metrics, save), layout.replay(name),
                            log=lambda line: print(line, file=sys.stderr, flush=True))  # the worker's log
    agent = trainer.agent
    reporter = TuneReporter(name, spec, context, tracker, run_id, agent.acting_modules, tuple(agent.modules()))
    try:
        checkpoint = tune.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as d:
                trainer.restore(Path(d))
            tracker.set_tags(run_id, {"qed.resumed_from_env_step": trainer.resumed_from})
        summary = trainer.run()
        # Recorded before the run ends, so a finished trial always has them when the gather step looks.
        tracker.record_checksums(run_id, recorded_values(layout, name))
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
