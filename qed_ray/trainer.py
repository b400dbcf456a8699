"""The only training loop (DESIGN.md §1-§4): warm-up, act, step, update, evaluate, checkpoint, report.

Everything is injected: env, agent, replay, reporter, RNG, device. The reporter receives the metrics of each
evaluation interval and a ``save`` callable that writes the checkpoint into a folder of the reporter's choice
(the CLI keeps one folder; Ray Tune hands a temporary folder to ``tune.report``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch

from qed_ray.agents.base import Agent
from qed_ray.checkpoint import load_checkpoint, save_checkpoint
from qed_ray.config import RunSpec
from qed_ray.envs import DMCEnv
from qed_ray.evaluate import eval_seeds, rollout
from qed_ray.networks import require_fp32_matmul
from qed_ray.replay import ReplayBuffer
from qed_ray.update_metrics import MetricAccumulator

SaveFn = Callable[[Path], None]


class Reporter(Protocol):
    """Receives one metrics dict per evaluation and may persist the checkpoint with ``save(folder)``."""

    def __call__(self, metrics: dict[str, float], save: SaveFn) -> None: ...


class DivergenceError(RuntimeError):
    """A non-finite loss, Q value or observation: the run stops with this reason."""


class InjectedCrash(RuntimeError):
    """Raised by ``train.debug_crash_at_env_step`` (fault-injection tests)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available (the device Ray assigned via CUDA_VISIBLE_DEVICES), else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class Progress:
    """Counters and history that make a resumed run continue exactly."""

    decisions: int = 0
    updates: int = 0
    episodes: int = 0
    wall_s: float = 0.0
    evals: list = field(default_factory=list)  # [env_steps, eval mean return, interval mean alpha]
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

    def save(self, directory: Path, policy_only: bool = False) -> None:
        """Writes the full run state into ``directory`` (replay chunks to ``replay_dir`` when set).

        With ``policy_only`` it writes a small snapshot instead: the agent's modules (no optimisers, RNG or
        replay), enough to act and to be compared across seeds (intermediate V, paper App. D).
        """
        if policy_only:
            env_steps = self.p.decisions * self.spec.train.frame_skip
            # Intermediate snapshots keep only what acting needs (MAD-SAC: 18 MB -> ~1 MB); the final one keeps
            # every module, since the critic-proxy analysis reads its critics (paper App. A).
            final = env_steps >= self.spec.train.env_steps
            names = self.agent.modules() if final else self.agent.acting_modules
            state = {k: m.state_dict() for k, m in self.agent.modules().items() if k in names}
            manifest = {**self.identity(), "env_steps": env_steps, "run": self.spec.model_dump(mode="json"),
                        "policy_only": True, "modules": sorted(state)}
            save_checkpoint(directory, state, manifest)
            return
        replay_loc = self.replay_dir if self.replay_dir is not None else Path(directory) / "replay"
        self.replay.save_incremental(replay_loc)
        manifest = {
            **self.identity(), "env_steps": self.p.decisions * self.spec.train.frame_skip,
            "run": self.spec.model_dump(mode="json"),
            "progress": {"decisions": self.p.decisions, "updates": self.p.updates, "episodes": self.p.episodes,
                         "wall_s": self.p.wall_s, "evals": self.p.evals},
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
        self.p = Progress(pr["decisions"], pr["updates"], pr["episodes"], pr["wall_s"], pr["evals"], [])
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
            if t.debug_crash_at_env_step is not None and env_steps == t.debug_crash_at_env_step \
                    and self.resumed_from is None:
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
            if spec.train.debug_nan_at_env_step == env_steps:
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
        self.p.evals.append([env_steps, mean, interval.get("alpha/actor_mean", math.nan)])
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
        alphas = [e[2] for e in evals if len(e) > 2 and math.isfinite(e[2])]
        return {
            "name": self.spec.name, "task": self.spec.task, "agent": self.spec.agent.name,
            "variant": self.spec.variant, "seed": self.spec.seed, "status": "finished",
            "env_steps": self.p.decisions * t.frame_skip, "decisions": self.p.decisions,
            "updates": self.p.updates, "wall_s": self.p.wall_s,
            "updates_per_s": self.p.updates / self.p.wall_s if self.p.wall_s else math.nan,
            "final_eval_return_mean": evals[-1][1] if evals else math.nan,
            "final_eval_return_std": last.get("eval/return_std", math.nan),
            "alpha_mean_over_training": float(np.mean(alphas)) if alphas else math.nan,
            "final_alpha": {k.removeprefix("alpha/"): v for k, v in last.items() if k.startswith("alpha/")},
            "evals": evals,
        }
