"""The worker side of a sweep trial: one Tune trial trains one pack of seed runs, records it in the sweep folder and
mirrors it to MLflow (docs/design.md: the trial row, "Trusting results", resume item 9). A diverged seed is final
(a deterministic continuation would diverge again); the results key comes in the context, never through the folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ray
from pydantic import Field
from ray import tune

from qed_ray.records.digests import Signer, record
from qed_ray.spec.config import Frozen
from qed_ray.records.layout import SweepDir
from qed_ray.rl.replay import prune_chunks
from qed_ray.rl.run_folder import FolderReporter
from qed_ray.service.lock import LockLost, check_holder
from qed_ray.service.packing import TuneTrial
from qed_ray.service.mlflow.tracking import (DIGEST_TAG, UNVERIFIED_TAG, TrialRun, digest_tags, limit_http_retries,
                                             pack_tags)
from qed_ray.rl.trainer import build_trainer


class TrialContext(Frozen):
    """What every trial of a sweep shares, set by the driver (the same on every start of a trial)."""

    sweep_id: str = Field(min_length=1, description="the sweep's stable id (sweep.json)")
    sweep_dir: Path = Field(strict=False, description="absolute sweep folder (a shared mount on a cluster)")
    tracking_uri: str = Field(min_length=1, description="MLflow tracking URI reachable from every node")
    experiment: str = Field(min_length=1, description="MLflow experiment")
    parent_run_id: str = Field(min_length=1, description="the sweep's MLflow parent run")
    keep_every: int = Field(1, ge=1, description="keep a policy snapshot every n-th evaluation (and the last)")
    gpu_fraction: float = Field(0.0, ge=0, le=1, description="this trial's GPU share (caps its GPU memory)")
    keep_replay: bool = Field(False, description="keep a finished trial's replay chunks (else they are deleted)")
    mlflow_timeout_s: float = Field(300.0, ge=0, le=86400, description="how long a finishing trial waits for "
                                                                       "an unreachable MLflow")
    env_workers: int = Field(0, ge=0, description="env worker processes per pack (pack.env_workers)")
    results_key: str | None = Field(None, repr=False, pattern="^[0-9a-f]{64}$",
                                    description="the user's results key (hex) that signs each seed's digest; None: "
                                                "nothing is signed, so the seeds are unverified")
    lock_token: str | None = Field(None, description="the driver's sweep.lock token; None: no fence")

    @property
    def layout(self) -> SweepDir:
        return SweepDir(self.sweep_dir)


def train_trial(config: dict, context: TrialContext) -> None:
    """Tune function trainable; the Ray boundary is crossed once, here (config -> the seeds' RunSpecs)."""
    tune_trial = TuneTrial.of(config)
    names, specs = tune_trial.names, [t.run for t in tune_trial.trials]
    pack, layout = tune_trial.id, context.layout
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - the worker's log
    limit_http_retries()
    # Outside Ray (a test, a local re-run) there is no node to record, and asking would start a Ray instance.
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    tags = pack_tags(pack.name, len(names))
    runs = [TrialRun(context.tracking_uri, context.experiment, context.sweep_id, context.parent_run_id, n,
                     s.model_dump(mode="json"), node_id=node, log=log, run_tags=tags) for n, s in zip(names, specs)]
    _limit_gpu_memory(context.gpu_fraction)

    def report(metrics: dict, save) -> None:  # the fence: nothing is written once another driver holds the sweep
        check_holder(layout.lock_file, context.lock_token)
        folder(metrics, save)

    key = bytes.fromhex(context.results_key) if context.results_key else None
    trainer = build_trainer(specs, report, [layout.replay(n) for n in names], names, context.env_workers, log,
                            pack=pack.name)
    folder = FolderReporter(layout, pack, trainer, context.keep_every, [[] for _ in names],
                            lambda metrics: _report(folder, runs, metrics),
                            None if key is None else Signer(key, context.sweep_id))
    try:
        resumed = folder.resume(log)
        for run, history in zip(runs, folder.histories):
            run.sync(history, tags={} if resumed is None else {"qed.resumed_from_env_step": resumed})
        try:
            trainer.run()
            check_holder(layout.lock_file, context.lock_token)
        except LockLost as e:
            log(f"{pack.name}: {e}; this trial stops, writing nothing more")
            return
        except Exception as e:  # noqa: BLE001 - note it on the runs (best-effort), then let Tune retry the pack
            for run, history in zip(runs, folder.histories):
                run.sync(history, tags={"qed.last_error": f"{type(e).__name__}: {e}"[:5000]})
            raise
    finally:
        trainer.close()
    _finish_diverged(folder, runs, context.mlflow_timeout_s)

    def finish(i: int, written: dict[str, str] | None, changed: list[str]) -> str | None:
        """Signs and records seed ``i``'s end; returns why its digest was not signed (None: it was)."""
        run, tags, timeout_s = runs[i], {"qed.status": "finished"}, context.mlflow_timeout_s
        if DIGEST_TAG in (run.tags() or {}):  # finished and signed before: its files are never signed again (M1)
            log(f"{names[i]}: its run already holds the digest its worker signed; not signed again"
                + (f" ({len(changed)} file(s) differ from what its worker wrote: {changed[0]}...)" if changed else ""))
            run.finish(folder.histories[i], tags=tags, timeout_s=timeout_s)
            return None
        if written is None:
            why = ("its final checkpoint, written by a qed_ray from before signed checkpoints, records none of its "
                   "files")
        elif key is None:
            why = "trained without a results key"
        else:  # the worker signs only the files it wrote (qed_ray.records.digests); nobody else signs them
            if run.finish(folder.histories[i], tags={**tags, **digest_tags(record(key, context.sweep_id, names[i],
                                                                                    written))}, timeout_s=timeout_s):
                return None
            return (f"tracking outage: MLflow at {context.tracking_uri} did not answer for {timeout_s:.0f} s when it "
                    f"finished, so its signed digest was never recorded")
        run.finish(folder.histories[i], tags={**tags, UNVERIFIED_TAG: why}, timeout_s=timeout_s)
        return why

    for name in folder.finish(finish):
        if not context.keep_replay:  # the pack has ended: no checkpoint of it needs the chunks again
            prune_chunks(layout.replay(name))


def _report(folder: FolderReporter, runs: list[TrialRun], metrics: dict[int, dict]) -> None:
    """An evaluation's report to Tune (the seeds' env steps together, ``seed_env_steps``) and to MLflow."""
    trainer, train = folder.trainer, folder.trainer.t
    step = int(next(iter(metrics.values()))["env_steps"])
    seed_steps = sum(m["env_steps"] for m in metrics.values()) + sum(
        r.stopped_at[0] * train.frame_skip for r in trainer.runs if r.stopped_at is not None)
    tune.report({"env_steps": step, "seed_env_steps": seed_steps, "seeds_running": len(metrics),
                 "eval/return_mean": float(sum(m["eval/return_mean"] for m in metrics.values()) / len(metrics))})
    for i in metrics:
        runs[i].sync(folder.histories[i])
    _finish_diverged(folder, runs, timeout_s=0)


def _finish_diverged(folder: FolderReporter, runs: list[TrialRun], timeout_s: float) -> None:
    """``DIVERGED.json`` and a FAILED run (with the reason) for each seed that diverged and has none yet."""
    for i in folder.record_diverged():
        reason = f"DivergenceError: {folder.trainer.runs[i].reason}"
        runs[i].finish(folder.histories[i], failed_reason=reason, timeout_s=timeout_s)


def _limit_gpu_memory(fraction: float) -> None:
    """Fractional GPUs are a scheduling fiction (no isolation): cap this trial's share of GPU memory."""
    import torch

    if 0 < fraction < 1 and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(fraction)
