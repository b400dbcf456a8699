"""The training loop of a pack: the S seeds of one (task, agent, variant) in one process, in lock-step.

Per decision: one batched act for the S observations, the S envs stepped (here or on env workers), one row per
seed into the pack's replay, one packed update (:class:`~qed_ray.agents.packed.PackedAgent`). Every evaluation
rolls out all seeds x episodes in lock-step with one policy call per step on envs built once
(:func:`~qed_ray.evaluate.rollout_lockstep`), and checkpoints are hashed and written by a background thread
(:class:`~qed_ray.writer.BackgroundWriter`).

Per seed, outward, nothing changes: each seed has its run spec, random streams, metrics, evaluations and a
checkpoint in the single-seed layout (loadable by :meth:`Trainer.restore <qed_ray.trainer.Trainer.restore>`).
A non-finite loss, Q value or observation stops that seed only: its status becomes "diverged" with the reason,
its env is no longer stepped, its replay rows and metric rows are ignored, its parameters are frozen, and its
last checkpoint stays the last one written before it diverged. The other seeds go on.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from qed_ray.agents.packed import PackedAgent, make_packed_agent
from qed_ray.atomic import write_json
from qed_ray.checkpoint import MANIFEST_FILE, load_checkpoint, save_checkpoint
from qed_ray.config import RunSpec
from qed_ray.env_pool import EnvPool
from qed_ray.evaluate import eval_seeds, rollout_lockstep
from qed_ray.pack import PACK_FILE, PACK_FORMAT, SeedRun, check_pack, pack_name, read_pack, seed_dir
from qed_ray.pack_update import PackUpdater, resolve_mode
from qed_ray.packed_replay import PackedReplay, replay_bytes, replay_device
from qed_ray.precision import apply_matmul_precision, set_run_precision
from qed_ray.replay import keeps_transition
from qed_ray.trainer import EvalRecord, InjectedCrash, resolve_device
from qed_ray.update_metrics import MetricAccumulator
from qed_ray.writer import BackgroundWriter

class PackSaveFn(Protocol):
    """``save(folder)`` writes the pack checkpoint; ``save(folder, modules=names, index=i)`` a policy snapshot of
    the pack's seed i. Both return the writer's future (the files exist once it is done)."""

    def __call__(self, directory: Path, modules: Sequence[str] | None = None, index: int | None = None
                 ) -> Future: ...


class PackReporter(Protocol):
    """Receives, at each evaluation, ``{pack index: metrics}`` of the seeds still training, and ``save``."""

    def __call__(self, metrics: dict[int, dict[str, float]], save: PackSaveFn) -> None: ...


class PackedTrainer:
    """Runs the S runs of a pack to their budget.

    Args:
        runs: one :class:`SeedRun` per seed, in pack order.
        pool: S training envs (indices 0..S-1) then S x E evaluation envs.
        agent, replay: the pack's agent and replay.
        reporter: metrics/checkpoint sink.
        writer: the background writer of checkpoint files.
        replay_dirs: per seed, where its replay chunks persist (None: inside each checkpoint).
        log: progress-line printer.
        name: the pack's name (default :func:`~qed_ray.pack.pack_name` of the runs; a sweep's names its axes).
    """

    def __init__(self, runs: list[SeedRun], pool: EnvPool, agent: PackedAgent, replay: PackedReplay,
                 reporter: PackReporter, writer: BackgroundWriter, replay_dirs: Sequence[Path] | None = None,
                 log: Callable[[str], None] = lambda s: None, name: str | None = None):
        self.runs, self.pool, self.agent, self.replay = runs, pool, agent, replay
        self.reporter, self.writer, self.replay_dirs, self.log = reporter, writer, replay_dirs, log
        self.t, self.n, self.name = runs[0].spec.train, len(runs), name or pack_name([r.spec for r in runs])
        self.active = np.ones(self.n, bool)
        self.decisions = self.updates = 0
        self.wall_s = 0.0
        self.resumed_from: int | None = None
        self.acc = MetricAccumulator(agent.metric_layout, agent.device, seeds=self.n)
        mode, why = resolve_mode(self.t.compile, agent.device, agent)
        self.precision, why_p = set_run_precision(agent.template.fn, self.t.precision, agent.device, mode)
        self.updater = PackUpdater(agent, replay, self.acc, mode, agent.spec.batch_size)
        log(f"pack {self.name}: update mode {mode} ({why}); precision {self.precision} ({why_p})")
        self.eval_index = self.n + np.arange(self.n * self.t.eval_episodes).reshape(self.n, -1)

    # ---- loop --------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        """Trains every seed to the budget (or until it diverges); returns the per-seed summaries. The
        checkpoint writes are flushed before it returns or raises."""
        t = self.t
        apply_matmul_precision(self.precision)  # agents built since __init__ reset it to FP32
        obs = np.zeros((self.n, self.pool.obs_dim), np.float32)
        fresh = np.ones(self.n, bool)  # episodes start lazily (a checkpoint at an episode end holds the env RNG)
        interval_start, interval_updates = time.perf_counter(), 0
        try:
            while self.decisions < t.decisions and self.active.any():
                env_steps = (self.decisions + 1) * t.frame_skip
                if env_steps == t.debug.crash_at_env_step and self.resumed_from is None:
                    raise InjectedCrash(f"injected crash at env step {env_steps}")
                on = np.flatnonzero(self.active)
                starting = on[fresh[on]]
                if len(starting):
                    obs[starting], fresh[starting] = self.pool.reset(starting), False
                obs, done = self._decide(obs, on, env_steps)
                self.decisions += 1
                if self.decisions > t.warmup_decisions:
                    interval_updates += self._update(env_steps)
                for i in np.flatnonzero(done & self.active):
                    run = self.runs[i]
                    run.train_returns.append(run.ep_return)
                    run.episodes, run.ep_return, fresh[i] = run.episodes + 1, 0.0, True
                if self.decisions % t.nan_check_every == 0:
                    self._check_finite(env_steps)
                if self.decisions % t.eval_every_decisions == 0:
                    self._evaluate_and_report(env_steps, time.perf_counter() - interval_start, interval_updates)
                    interval_start, interval_updates = time.perf_counter(), 0
            for run in self.runs:
                run.status = self._status(run)
        finally:
            self.writer.flush()
        return self.summaries()

    def _decide(self, obs: np.ndarray, on: np.ndarray, env_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Acts, steps the active envs, stores their transitions; returns (next obs, episode ended) [S]."""
        if self.decisions < self.t.warmup_decisions:
            actions = np.zeros((self.n, self.pool.action_dim), np.float32)
            for i in on:
                actions[i] = self.runs[i].warmup_rng.uniform(-1.0, 1.0, self.pool.action_dim).astype(np.float32)
        else:
            actions = self.agent.act(obs, self.active)
        step = self.pool.step(on, actions[on])
        nxt, reward, terminated, done = obs.copy(), np.zeros(self.n), np.zeros(self.n, bool), np.zeros(self.n, bool)
        nxt[on], reward[on], terminated[on], done[on] = step.obs, step.reward, step.terminated, \
            step.terminated | step.truncated
        for i in on[~np.isfinite(step.obs).all(axis=1)]:
            self._stop(i, f"non-finite observation at env step {env_steps}")
        truncated = done & ~terminated
        keep = [keeps_transition(self.t, run.spec.seed, self.decisions, bool(truncated[i]))
                for i, run in enumerate(self.runs)]
        self.replay.add(obs, actions, reward, nxt, terminated, self.active & np.array(keep))
        for i in np.flatnonzero(self.active):
            self.runs[i].ep_return += reward[i]
        return nxt, done

    def _update(self, env_steps: int) -> int:
        b = self.agent.spec.batch_size
        for _ in range(self.agent.spec.utd):
            idx = self.replay.indices(b, self.active)
            poisoned = [i for i in np.flatnonzero(self.active) if self.t.debug.nan.hits(self.runs[i].spec.seed,
                                                                                          env_steps)]
            if poisoned:  # fault injection: a real NaN that flows into seed i's critic loss (an eager update)
                batch = self.replay.gather(idx)
                batch["reward"][poisoned, 0] = float("nan")
                self.updater.eager(batch, self.agent.noise(b, self.active))
            else:
                self.updater(idx, self.agent.noise(b, self.active))
            self.updates += 1
        return self.agent.spec.utd

    def _check_finite(self, env_steps: int) -> None:
        bad = self.acc.non_finite_per_seed(("loss/", "q/"))  # one sync
        for i in np.flatnonzero(self.active):
            if bad[i]:
                self._stop(i, f"non-finite {', '.join(bad[i])} by env step {env_steps} (decision {self.decisions}, "
                              f"update {self.updates})")

    def _stop(self, i: int, reason: str) -> None:
        run = self.runs[i]
        run.status, run.reason, run.stopped_at = "diverged", reason, (self.decisions, self.updates)
        self.active[i] = False
        self.agent.freeze(i)
        self.log(f"{run.name} stopped (the other seeds of {self.name} go on): {reason}")

    def _evaluate_and_report(self, env_steps: int, elapsed: float, interval_updates: int) -> None:
        self._check_finite(env_steps)
        self.wall_s += elapsed
        t0 = time.perf_counter()
        returns = rollout_lockstep(self.agent.act_deterministic, self.pool, self.eval_index,
                                   eval_seeds(self.t.eval_episodes), self.active)
        eval_s = time.perf_counter() - t0
        interval = self.acc.means_per_seed()
        metrics = {}
        for i in np.flatnonzero(self.active):
            metrics[int(i)] = self._metrics(self.runs[i], returns[i], interval[i], env_steps, elapsed,
                                            interval_updates, eval_s)
        self.reporter(metrics, self.save)
        for i, m in metrics.items():
            self.log(f"{self.runs[i].name} env_steps={env_steps} eval={m['eval/return_mean']:.1f} "
                     f"alpha={m.get('alpha/actor_mean', float('nan')):.4f} ups={m['perf/updates_per_s']:.1f}")

    def _metrics(self, run: SeedRun, returns: np.ndarray, interval: dict, env_steps: int, elapsed: float,
                 interval_updates: int, eval_s: float) -> dict[str, float]:
        """One seed's evaluation metrics: the keys :class:`~qed_ray.trainer.Trainer` reports."""
        mean = float(returns.mean())
        run.evals.append(EvalRecord(env_steps, mean, interval.get("alpha/actor_mean", math.nan),
                                    interval.get("q/abs_diff_mean", math.nan)))
        metrics = {
            "env_steps": env_steps, "decisions": self.decisions, "updates": self.updates, "episodes": run.episodes,
            "eval/return_mean": mean, "eval/return_std": float(returns.std()),
            "eval/return_min": float(returns.min()), "eval/return_max": float(returns.max()),
            "perf/updates_per_s": interval_updates / max(elapsed, 1e-9),
            "perf/env_steps_per_s": self.t.eval_every / max(elapsed, 1e-9), "perf/eval_s": eval_s,
            "perf/wall_s": self.wall_s,
        }
        if run.train_returns:
            metrics["train/episode_return"] = float(np.mean(run.train_returns))
        metrics.update(interval)
        run.train_returns, run.last_metrics = [], metrics
        for warning in self.agent.template.report_warnings(metrics):
            self.log(f"WARNING {run.name} at env step {env_steps}: {warning}")
        return metrics

    # ---- checkpoints ---------------------------------------------------------------------------------------
    def identity(self, i: int) -> dict:
        """Fields seed ``i``'s checkpoint must match (as :meth:`Trainer.identity`)."""
        s = self.runs[i].spec
        return {"task": s.task, "agent": s.agent.name, "variant": s.variant, "seed": s.seed,
                "obs_dim": self.pool.obs_dim, "action_dim": self.pool.action_dim}

    def save(self, directory: Path, modules: Sequence[str] | None = None, index: int | None = None) -> Future:
        """Queues the pack checkpoint (or, with ``modules`` and ``index``, a policy snapshot of seed ``index``,
        as :meth:`Trainer.save` writes it) for the writer thread; the state is copied before this returns."""
        directory = Path(directory)
        env_steps = self.decisions * self.t.frame_skip
        if modules is not None:
            state = self.agent.module_state_dicts(index, modules)
            # As Trainer.save: the evaluation history and wall time ride along for the gather step and --status.
            manifest = {**self.identity(index), "env_steps": env_steps,
                        "run": self.runs[index].spec.model_dump(mode="json"), "policy_only": True,
                        "modules": sorted(state), "evals": [e.to_json() for e in self.runs[index].evals],
                        "wall_s": self.wall_s}
            return self.writer.submit(directory, lambda: save_checkpoint(directory, state, manifest))
        seeds, chunks = [], []
        for i, run in enumerate(self.runs):
            if run.status != "diverged":
                run.saved = (self.agent.seed_state_dict(i), self._manifest(i))
            if run.saved is not None:
                sub = directory / seed_dir(run.spec.seed)
                loc = self.replay_dirs[i] if self.replay_dirs is not None else sub / "replay"
                if run.status != "diverged":
                    chunks.append(self.replay.plan_save(i, loc))
                elif self.replay_dirs is None:  # a new checkpoint folder needs the rows its manifest counts
                    chunks.append(self.replay.plan_save(i, loc, run.saved[1]["replay"]["added"]))
                seeds.append((sub, *run.saved))
        pack = {"format": PACK_FORMAT, "pack": self.name, "names": [r.name for r in self.runs],
                "seeds": [r.spec.seed for r in self.runs], "pack_size": self.n, "env_steps": env_steps,
                "decisions": self.decisions, "updates": self.updates, "wall_s": self.wall_s,
                "status": [self._status(r) for r in self.runs], "reasons": [r.reason for r in self.runs],
                "stopped_at": [r.stopped_at for r in self.runs]}

        def write() -> None:
            for chunk in chunks:
                chunk.write()
            for sub, state, manifest in seeds:
                save_checkpoint(sub, state, manifest)
            write_json(directory / PACK_FILE, pack, indent=1)  # last: it marks a complete pack checkpoint

        return self.writer.submit(directory, write)

    def _status(self, run: SeedRun) -> str:
        """``running``, ``diverged``, or ``finished`` once the budget is done (also in the final checkpoint)."""
        return "finished" if run.status == "running" and self.decisions >= self.t.decisions else run.status

    def _manifest(self, i: int) -> dict:
        """Seed ``i``'s manifest: :meth:`Trainer.save`'s, plus where it sits in the pack."""
        run = self.runs[i]
        return {
            **self.identity(i), "env_steps": self.decisions * self.t.frame_skip,
            "run": run.spec.model_dump(mode="json"),
            "progress": {"decisions": self.decisions, "updates": self.updates, "episodes": run.episodes,
                         "wall_s": self.wall_s, "evals": [e.to_json() for e in run.evals]},
            "rng": {"warmup": run.warmup_rng.bit_generator.state, "replay": self.replay.rng_state(i),
                    "env": self.pool.random_state(i)},
            "replay": {"added": int(self.replay.added[i]), "external": self.replay_dirs is not None},
            "pack": self.name, "pack_size": self.n, "pack_index": i,
        }

    def restore(self, directory: Path) -> dict:
        """Loads a pack checkpoint written by :meth:`save` (same seeds, same pack size); returns its pack.json.

        Raises:
            CheckpointError: a missing or corrupt file, another pack, or a seed checkpoint that does not match.
        """
        directory = Path(directory)
        pack = read_pack(directory, [r.spec.seed for r in self.runs])
        states, manifests = [], []
        for i, run in enumerate(self.runs):
            sub = directory / seed_dir(run.spec.seed)
            if pack["status"][i] == "diverged" and not (sub / MANIFEST_FILE).exists():
                states.append(None), manifests.append(None)  # diverged before its first checkpoint
                continue
            state, m = load_checkpoint(sub, expect={**self.identity(i), "pack_size": self.n, "pack_index": i},
                                       map_location="cpu")
            states.append(state), manifests.append(m)
        self.agent.load_seed_state_dicts(states)
        for i, (run, m) in enumerate(zip(self.runs, manifests)):
            self._restore_seed(i, run, m, states[i], directory)
            if pack["status"][i] == "diverged":
                run.status, run.reason, run.stopped_at = "diverged", pack["reasons"][i], tuple(pack["stopped_at"][i])
                self.active[i] = False
                self.agent.freeze(i)
        self.decisions, self.updates, self.wall_s = pack["decisions"], pack["updates"], pack["wall_s"]
        self.resumed_from = pack["env_steps"]
        return pack

    def _restore_seed(self, i: int, run: SeedRun, m: dict | None, state: dict | None, directory: Path) -> None:
        """Seed ``i``'s counters, history, random streams and replay from its manifest (None: it has none)."""
        if m is None:
            return
        pr = m["progress"]
        run.episodes, run.evals = pr["episodes"], [EvalRecord.from_json(e) for e in pr["evals"]]
        run.warmup_rng.bit_generator.state = m["rng"]["warmup"]
        self.replay.set_rng_state(i, m["rng"]["replay"])
        self.pool.set_random_state(i, m["rng"]["env"])
        src = self.replay_dirs[i] if m["replay"]["external"] else directory / seed_dir(run.spec.seed) / "replay"
        self.replay.load(i, src, m["replay"]["added"])
        rewritten = ("format_version", "versions", "state_sha256")  # save_checkpoint writes these afresh
        run.saved = (state, {k: v for k, v in m.items() if k not in rewritten})

    # ---- results -------------------------------------------------------------------------------------------
    def summaries(self) -> list[dict]:
        """Per seed, the summary :meth:`Trainer.summary` gives a single run (plus ``reason`` if it diverged)."""
        return [self._summary(run) for run in self.runs]

    def _summary(self, run: SeedRun) -> dict:
        s, t = run.spec, self.t
        decisions, updates = run.stopped_at or (self.decisions, self.updates)
        alphas = [e.alpha_mean for e in run.evals if math.isfinite(e.alpha_mean)]
        last = run.last_metrics
        out = {
            "name": s.name, "task": s.task, "agent": s.agent.name, "variant": s.variant, "seed": s.seed,
            "status": self._status(run), "env_steps": decisions * t.frame_skip,
            "decisions": decisions, "updates": updates, "wall_s": self.wall_s, "precision": self.precision,
            "updates_per_s": updates / self.wall_s if self.wall_s else math.nan,
            "final_eval_return_mean": run.evals[-1].return_mean if run.evals else math.nan,
            "final_eval_return_std": last.get("eval/return_std", math.nan),
            "alpha_mean_over_training": float(np.mean(alphas)) if alphas else math.nan,
            "final_alpha": {k.removeprefix("alpha/"): v for k, v in last.items() if k.startswith("alpha/")},
            "evals": [e.to_json() for e in run.evals],
        }
        if run.reason is not None:
            out["reason"] = run.reason
        return out

    def close(self) -> None:
        """Flushes the writer and frees the envs (and their workers)."""
        try:
            self.writer.flush()
        finally:
            self.pool.close()


def build_packed_trainer(specs: Sequence[RunSpec], reporter: PackReporter, replay_dirs: Sequence[Path] | None,
                         names: Sequence[str] | None = None, env_workers: int = 0,
                         log: Callable[[str], None] = print, writer: BackgroundWriter | None = None,
                         pack: str | None = None) -> PackedTrainer:
    """Builds the envs, the pack's agent, replay, per-seed RNGs and the writer for ``specs`` (runs that differ
    only in seed) and injects them into a :class:`PackedTrainer`. Every seed's random streams are derived exactly
    as :func:`~qed_ray.trainer.build_trainer` derives them for that seed alone.

    Args:
        specs: the runs, in pack order.
        reporter: metrics/checkpoint sink.
        replay_dirs: per seed, its replay folder (None: replay inside each checkpoint).
        names: per seed, its trial name (default: ``spec.name``).
        env_workers: env worker processes (0: step the envs in this process).
        log: progress-line printer.
        writer: the background writer (default: a new one; :meth:`PackedTrainer.close` flushes it).
        pack: the pack's name (default: :func:`~qed_ray.pack.pack_name` of ``specs``).
    """
    check_pack(specs)
    spec, t = specs[0], specs[0].train
    torch.set_num_threads(t.threads)
    device = resolve_device(t.device)
    seeds = [s.seed for s in specs]
    env_seeds = seeds + eval_seeds(t.eval_episodes) * len(seeds)  # eval envs are reseeded before every use
    pool = EnvPool(spec.task, env_seeds, t.frame_skip, env_workers)
    agent = make_packed_agent(spec.agent, spec.temperature, pool.obs_dim, pool.action_dim, device, seeds)
    capacity = t.replay_capacity or t.decisions
    # Per seed: independent streams for the buffer sampler and warm-up actions, derived from the run seed.
    streams = [[np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)] for seed in seeds]
    nbytes = replay_bytes(len(seeds), capacity, pool.obs_dim, pool.action_dim)
    replay = PackedReplay(capacity, pool.obs_dim, pool.action_dim, [r for r, _ in streams], device,
                          replay_device(device, nbytes))
    runs = [SeedRun(s, n, w) for s, n, (_, w) in zip(specs, names or [s.name for s in specs], streams)]
    log(f"pack {pack or pack_name(specs)}: {len(seeds)} seeds on {device}, replay {nbytes / 2**20:.1f} MiB on "
        f"{replay.storage.device}, {env_workers} env workers")
    return PackedTrainer(runs, pool, agent, replay, reporter, writer or BackgroundWriter(), replay_dirs, log, pack)
