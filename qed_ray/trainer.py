"""The single-seed training loop: warm-up, act, step, update, evaluate, checkpoint, report (a pack of seeds runs
the same steps for S seeds at once in :mod:`qed_ray.packed_trainer`).

Everything is injected: env, agent, replay, reporter, RNG, device; :func:`build_trainer` is the one place a run's
objects are built. The reporter receives the metrics of each evaluation interval and a ``save`` callable that
writes the checkpoint (or a policy snapshot of the modules it names) into a folder of the reporter's choice (the
CLI keeps one folder; Ray Tune hands a temporary folder to ``tune.report``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from qed_ray.agents import make_agent
from qed_ray.agents.base import Agent
from qed_ray.checkpoint import load_checkpoint, save_checkpoint
from qed_ray.config import RunSpec
from qed_ray.envs import DMCEnv, make_env
from qed_ray.evaluate import eval_seeds, rollout
from qed_ray.networks import require_fp32_matmul
from qed_ray.replay import ReplayBuffer
from qed_ray.update_metrics import MetricAccumulator


class SaveFn(Protocol):
    """``save(folder)`` writes the full resumable checkpoint; ``save(folder, modules=names)`` a policy snapshot."""

    def __call__(self, directory: Path, modules: Sequence[str] | None = None) -> None: ...


class Reporter(Protocol):
    """Receives one metrics dict per evaluation and may persist the run with ``save`` (see :class:`SaveFn`)."""

    def __call__(self, metrics: dict[str, float], save: SaveFn) -> None: ...


class DivergenceError(RuntimeError):
    """A non-finite loss, Q value or observation: the run stops with this reason."""


class InjectedCrash(RuntimeError):
    """Raised by ``train.debug.crash_at_env_step`` (fault-injection tests)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available (the device Ray assigned via CUDA_VISIBLE_DEVICES), else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation of a run: env steps, mean deterministic eval return, mean actor alpha of its interval."""

    env_steps: int
    return_mean: float
    alpha_mean: float  # NaN when the interval had no update (all warm-up)

    def to_json(self) -> dict:
        """``{"env_steps", "return_mean", "alpha_mean"}`` (as stored in manifests and ``summary.json``)."""
        return {"env_steps": self.env_steps, "return_mean": self.return_mean, "alpha_mean": self.alpha_mean}

    @classmethod
    def from_json(cls, d: dict) -> "EvalRecord":
        """Inverse of :meth:`to_json`."""
        return cls(int(d["env_steps"]), float(d["return_mean"]), float(d["alpha_mean"]))


@dataclass
class Progress:
    """Counters and history that make a resumed run continue exactly."""

    decisions: int = 0
    updates: int = 0
    episodes: int = 0
    wall_s: float = 0.0
    evals: list[EvalRecord] = field(default_factory=list)
    train_returns: list = field(default_factory=list)  # returns of finished training episodes this interval


class Trainer:
    """Runs one :class:`RunSpec` to its budget.

    Args:
        spec: the run.
        env: training env (its RNG state is checkpointed).
        agent: SAC-LN or MAD-SAC.
        replay: the buffer.
        reporter: metrics/checkpoint sink.
        rng: draws warm-up actions.
        replay_dir: where replay chunks persist across checkpoints (None: each checkpoint carries the buffer).
        log: progress-line printer.
    """

    def __init__(self, spec: RunSpec, env: DMCEnv, agent: Agent, replay: ReplayBuffer, reporter: Reporter,
                 rng: np.random.Generator, replay_dir: Path | None = None,
                 log: Callable[[str], None] = lambda s: None):
        self.spec, self.env, self.agent, self.replay = spec, env, agent, replay
        self.reporter, self.rng, self.replay_dir, self.log = reporter, rng, replay_dir, log
        self.p = Progress()
        self.resumed_from: int | None = None
        self._acc = MetricAccumulator(agent.metric_layout, agent.device)  # interval sums/max/min on the device
        self.last_metrics: dict[str, float] = {}

    # ---- checkpoint ------------------------------------------------------------------------------
    def identity(self) -> dict:
        """Fields a checkpoint must match to be resumed by this run."""
        s = self.spec
        return {"task": s.task, "agent": s.agent.name, "variant": s.variant, "seed": s.seed,
                "obs_dim": self.env.obs_dim, "action_dim": self.env.action_dim}

    def save(self, directory: Path, modules: Sequence[str] | None = None) -> None:
        """Writes the full run state into ``directory`` (replay chunks to ``replay_dir`` when set).

        With ``modules`` (names from ``agent.modules()``) it writes a small policy snapshot of just those modules
        instead (no optimisers, RNG or replay): enough to act and to be compared across seeds. Which modules a
        snapshot keeps is the caller's decision.
        """
        if modules is not None:
            have = self.agent.modules()
            unknown = sorted(set(modules) - set(have))
            if unknown:
                raise ValueError(f"modules: {unknown} are not modules of {self.spec.agent.name} ({sorted(have)})")
            state = {k: m.state_dict() for k, m in have.items() if k in modules}
            manifest = {**self.identity(), "env_steps": self.p.decisions * self.spec.train.frame_skip,
                        "run": self.spec.model_dump(mode="json"), "policy_only": True, "modules": sorted(state)}
            save_checkpoint(directory, state, manifest)
            return
        replay_loc = self.replay_dir if self.replay_dir is not None else Path(directory) / "replay"
        self.replay.save_incremental(replay_loc)
        manifest = {
            **self.identity(), "env_steps": self.p.decisions * self.spec.train.frame_skip,
            "run": self.spec.model_dump(mode="json"),
            "progress": {"decisions": self.p.decisions, "updates": self.p.updates, "episodes": self.p.episodes,
                         "wall_s": self.p.wall_s, "evals": [e.to_json() for e in self.p.evals]},
            "rng": {"warmup": self.rng.bit_generator.state, "replay": self.replay.rng_state(),
                    "env": self.env.random_state()},
            "replay": {"added": self.replay.added, "external": self.replay_dir is not None},
        }
        save_checkpoint(directory, self.agent.state_dict(), manifest)

    def restore(self, directory: Path) -> dict:
        """Loads a checkpoint written by :meth:`save`; returns its manifest."""
        state, m = load_checkpoint(directory, expect=self.identity(), map_location=self.agent.device)
        self.agent.load_state_dict(state)
        pr = m["progress"]
        self.p = Progress(pr["decisions"], pr["updates"], pr["episodes"], pr["wall_s"],
                          [EvalRecord.from_json(e) for e in pr["evals"]], [])
        self.rng.bit_generator.state = m["rng"]["warmup"]
        self.replay.set_rng_state(m["rng"]["replay"])
        self.env.set_random_state(m["rng"]["env"])
        src = self.replay_dir if m["replay"]["external"] else Path(directory) / "replay"
        self.replay.load_incremental(src, m["replay"]["added"])
        self.resumed_from = m["env_steps"]
        return m

    # ---- loop ------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Trains to ``spec.train.env_steps``; returns the final summary. Raises DivergenceError on NaN/inf."""
        t = self.spec.train
        require_fp32_matmul()  # every critic pass feeding QED or the TD target stays FP32 (no TF32)
        obs = None  # episodes start lazily so a checkpoint taken at an episode end holds the pre-reset env RNG
        ep_return = 0.0
        interval_start = time.perf_counter()
        interval_updates = 0
        while self.p.decisions < t.decisions:
            env_steps = (self.p.decisions + 1) * t.frame_skip
            if env_steps == t.debug.crash_at_env_step and self.resumed_from is None:
                raise InjectedCrash(f"injected crash at env step {env_steps}")
            if obs is None:
                obs = self.env.reset()
            if self.p.decisions < t.warmup_decisions:
                action = self.rng.uniform(-1.0, 1.0, self.env.action_dim).astype(np.float32)
            else:
                action = self.agent.act(obs, deterministic=False)
            step = self.env.step(action)
            if not np.all(np.isfinite(step.obs)):
                raise DivergenceError(f"non-finite observation at env step {env_steps}")
            self.replay.add(obs, action, step.reward, step.obs, step.terminated)
            ep_return += step.reward
            obs = step.obs
            self.p.decisions += 1
            if self.p.decisions > t.warmup_decisions:
                interval_updates += self._update(env_steps)
            if step.terminated or step.truncated:
                self.p.train_returns.append(ep_return)
                self.p.episodes += 1
                ep_return = 0.0
                obs = None
            if self.p.decisions % t.nan_check_every == 0:
                self._check_finite(env_steps)
            if self.p.decisions % t.eval_every_decisions == 0:
                elapsed = time.perf_counter() - interval_start
                self._evaluate_and_report(env_steps, elapsed, interval_updates)
                interval_start, interval_updates = time.perf_counter(), 0
        return self.summary()

    def _update(self, env_steps: int) -> int:
        spec = self.spec
        for _ in range(spec.agent.utd):
            batch = self.replay.sample(spec.agent.batch_size, self.agent.device)
            if spec.train.debug.nan.hits(spec.seed, env_steps):
                batch["reward"][0] = float("nan")  # a real NaN that flows into the critic loss
            self._acc.add(self.agent.update(batch))  # one metric vector, folded in on the device
            self.p.updates += 1
        return spec.agent.utd

    def _check_finite(self, env_steps: int) -> None:
        bad = self._acc.non_finite(("loss/", "q/"))  # one sync
        if bad:
            raise DivergenceError(f"non-finite {', '.join(bad)} by env step {env_steps} "
                                  f"(decision {self.p.decisions}, update {self.p.updates})")

    def _evaluate_and_report(self, env_steps: int, elapsed: float, interval_updates: int) -> None:
        t = self.spec.train
        self._check_finite(env_steps)
        self.p.wall_s += elapsed
        t0 = time.perf_counter()
        ev = rollout(self.agent.act_batch, self.spec.task, eval_seeds(t.eval_episodes), frame_skip=t.frame_skip)
        eval_s = time.perf_counter() - t0
        mean = float(ev.returns.mean())
        interval = self._acc.means()
        self.p.evals.append(EvalRecord(env_steps, mean, interval.get("alpha/actor_mean", math.nan)))
        metrics = {
            "env_steps": env_steps, "decisions": self.p.decisions, "updates": self.p.updates,
            "episodes": self.p.episodes,
            "eval/return_mean": mean, "eval/return_std": float(ev.returns.std()),
            "eval/return_min": float(ev.returns.min()), "eval/return_max": float(ev.returns.max()),
            "perf/updates_per_s": interval_updates / max(elapsed, 1e-9),
            "perf/env_steps_per_s": t.eval_every / max(elapsed, 1e-9), "perf/eval_s": eval_s,
            "perf/wall_s": self.p.wall_s,
        }
        if self.p.train_returns:
            metrics["train/episode_return"] = float(np.mean(self.p.train_returns))
        metrics.update(interval)
        self.p.train_returns = []
        self.last_metrics = metrics
        for warning in self.agent.report_warnings(metrics):
            self.log(f"WARNING {self.spec.name} at env step {env_steps}: {warning}")
        self.reporter(metrics, self.save)
        self.log(f"{self.spec.name} env_steps={env_steps} eval={mean:.1f} "
                 f"alpha={metrics.get('alpha/actor_mean', float('nan')):.4f} "
                 f"ups={metrics['perf/updates_per_s']:.1f}")

    def summary(self) -> dict:
        """Final figures of the run (the CLI writes them to ``summary.json``)."""
        t = self.spec.train
        evals = self.p.evals
        last = self.last_metrics
        alphas = [e.alpha_mean for e in evals if math.isfinite(e.alpha_mean)]
        return {
            "name": self.spec.name, "task": self.spec.task, "agent": self.spec.agent.name,
            "variant": self.spec.variant, "seed": self.spec.seed, "status": "finished",
            "env_steps": self.p.decisions * t.frame_skip, "decisions": self.p.decisions,
            "updates": self.p.updates, "wall_s": self.p.wall_s,
            "updates_per_s": self.p.updates / self.p.wall_s if self.p.wall_s else math.nan,
            "final_eval_return_mean": evals[-1].return_mean if evals else math.nan,
            "final_eval_return_std": last.get("eval/return_std", math.nan),
            "alpha_mean_over_training": float(np.mean(alphas)) if alphas else math.nan,
            "final_alpha": {k.removeprefix("alpha/"): v for k, v in last.items() if k.startswith("alpha/")},
            "evals": [e.to_json() for e in evals],
        }


def build_trainer(spec: RunSpec, reporter: Reporter, replay_dir: Path | None,
                  log: Callable[[str], None] = print) -> Trainer:
    """Builds env, agent, replay, RNG and device for ``spec`` and injects them into a :class:`Trainer`."""
    torch.set_num_threads(spec.train.threads)
    device = resolve_device(spec.train.device)
    env = make_env(spec.task, spec.seed, spec.train.frame_skip)
    agent = make_agent(spec.agent, spec.temperature, env.obs_dim, env.action_dim, device, spec.seed)
    capacity = spec.train.replay_capacity or spec.train.decisions
    # Independent streams for the buffer sampler and warm-up actions, derived from the run seed.
    replay_rng, warmup_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(2))
    replay = ReplayBuffer(capacity, env.obs_dim, env.action_dim, replay_rng)
    return Trainer(spec, env, agent, replay, reporter, warmup_rng, replay_dir, log)
