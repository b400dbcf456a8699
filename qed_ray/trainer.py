"""The single-seed training loop: warm-up, act, step, update, evaluate, checkpoint, report (a pack of seeds runs
the same steps for S seeds at once in :mod:`qed_ray.packed_trainer`).

Everything is injected: env, agent, replay, reporter, RNG, device; :func:`build_trainer` is the one place a run's
objects are built. The reporter receives the metrics of each evaluation interval and a ``save`` callable that
writes the checkpoint (or a policy snapshot of the modules it names) into a folder of the reporter's choice (the
CLI keeps one folder; a sweep trial keeps its newest two under the sweep folder's ``checkpoints/<trial>/``).
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
from qed_ray.config import RunSpec, TrainSpec
from qed_ray.envs import DMCEnv, make_env
from qed_ray.evaluate import eval_seeds, rollout
from qed_ray.precision import apply_matmul_precision, set_run_precision
from qed_ray.replay import ReplayBuffer, keeps_transition
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
    """One evaluation of a run: env steps, mean deterministic eval return, and two interval means of its updates:
    the actor's alpha and the double-critic gap |Q1 - Q2| (the critic proxy's x, paper App. D)."""

    env_steps: int
    return_mean: float
    alpha_mean: float  # NaN when the interval had no update (all warm-up)
    q_gap_mean: float = math.nan  # ditto

    def to_json(self) -> dict:
        """``{"env_steps", "return_mean", "alpha_mean", "q_gap_mean"}`` (in manifests and ``summary.json``)."""
        return {"env_steps": self.env_steps, "return_mean": self.return_mean, "alpha_mean": self.alpha_mean,
                "q_gap_mean": self.q_gap_mean}

    @classmethod
    def from_json(cls, d: dict) -> "EvalRecord":
        """Inverse of :meth:`to_json` (a record written before ``q_gap_mean`` existed reads it as NaN: unknown)."""
        return cls(int(d["env_steps"]), float(d["return_mean"]), float(d["alpha_mean"]),
                   float(d.get("q_gap_mean", math.nan)))


def remaining_s(train: TrainSpec, decisions: int, evals_done: int, warmup_s_per_decision: float | None,
                train_s_per_decision: float | None, eval_s_per_eval: float | None) -> float | None:
    """Seconds left to finish a run: its warm-up, training and evaluation decisions at their measured costs.

    Warm-up decisions (no updates) are much cheaper than training ones and every evaluation rolls out
    ``eval_episodes`` whole episodes, so one overall rate would be wrong in both directions. Before the first
    evaluation its cost is estimated as that many episodes at the warm-up cost per decision (stepping the physics
    dominates both). None while a needed cost is still unmeasured.
    """
    warm_left = max(0, train.warmup_decisions - decisions)
    train_left = train.decisions - max(decisions, train.warmup_decisions)
    evals_left = train.decisions // train.eval_every_decisions - evals_done
    if eval_s_per_eval is None and warmup_s_per_decision is not None:
        eval_s_per_eval = train.eval_episodes * train.episode_decisions * warmup_s_per_decision
    parts = [(warm_left, warmup_s_per_decision), (train_left, train_s_per_decision), (evals_left, eval_s_per_eval)]
    if any(n > 0 and cost is None for n, cost in parts):
        return None
    return float(sum(n * cost for n, cost in parts if n > 0))


@dataclass
class Progress:
    """Counters and history that make a resumed run continue exactly."""

    decisions: int = 0
    updates: int = 0
    episodes: int = 0
    wall_s: float = 0.0  # real time inside run(), summed over every start of the run
    evals: list[EvalRecord] = field(default_factory=list)
    train_returns: list = field(default_factory=list)  # returns of finished training episodes this interval
    warmup_s: float = 0.0  # time spent in warm-up decisions
    train_s: float = 0.0  # time spent in decisions with updates
    eval_s: float = 0.0  # time spent evaluating and reporting (checkpoints, snapshots, logging)

    def to_json(self) -> dict:
        """The ``progress`` entry of a checkpoint manifest."""
        return {"decisions": self.decisions, "updates": self.updates, "episodes": self.episodes,
                "wall_s": self.wall_s, "evals": [e.to_json() for e in self.evals], "warmup_s": self.warmup_s,
                "train_s": self.train_s, "eval_s": self.eval_s}

    @classmethod
    def from_json(cls, d: dict) -> "Progress":
        """Inverse of :meth:`to_json` (timings a checkpoint written before they existed lack read as 0)."""
        return cls(d["decisions"], d["updates"], d["episodes"], d["wall_s"],
                   [EvalRecord.from_json(e) for e in d["evals"]], [],
                   d.get("warmup_s", 0.0), d.get("train_s", 0.0), d.get("eval_s", 0.0))


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
                 log: Callable[[str], None] = lambda s: None,
                 heartbeat: Callable[[dict], None] | None = None, heartbeat_s: float = 30.0):
        self.spec, self.env, self.agent, self.replay = spec, env, agent, replay
        self.reporter, self.rng, self.replay_dir, self.log = reporter, rng, replay_dir, log
        self.heartbeat, self.heartbeat_s = heartbeat, heartbeat_s
        self.p = Progress()
        self._wall_base, self._t_start, self._t_mark = 0.0, None, time.perf_counter()  # _t_start: set in run()
        self.resumed_from: int | None = None
        self._acc = MetricAccumulator(agent.metric_layout, agent.device)  # interval sums/max/min on the device
        self.last_metrics: dict[str, float] = {}
        self.precision, why = set_run_precision(agent.fn, spec.train.precision, agent.device)
        log(f"{spec.name}: precision {self.precision} ({why})")

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
            # The evaluation history and wall time ride along, so the gather step and --status read a finished
            # or running trial from its snapshots alone (learning curves, critic-proxy x of App. D, cost so far).
            manifest = {**self.identity(), "env_steps": self.p.decisions * self.spec.train.frame_skip,
                        "run": self.spec.model_dump(mode="json"), "policy_only": True, "modules": sorted(state),
                        "evals": [e.to_json() for e in self.p.evals], "wall_s": self.wall_s()}
            save_checkpoint(directory, state, manifest)
            return
        replay_loc = self.replay_dir if self.replay_dir is not None else Path(directory) / "replay"
        self.replay.save_incremental(replay_loc)
        manifest = {
            **self.identity(), "env_steps": self.p.decisions * self.spec.train.frame_skip,
            "run": self.spec.model_dump(mode="json"),
            "progress": {**self.p.to_json(), "wall_s": self.wall_s()},
            "rng": {"warmup": self.rng.bit_generator.state, "replay": self.replay.rng_state(),
                    "env": self.env.random_state()},
            "replay": {"added": self.replay.added, "external": self.replay_dir is not None},
        }
        save_checkpoint(directory, self.agent.state_dict(), manifest)

    def restore(self, directory: Path) -> dict:
        """Loads a checkpoint written by :meth:`save`; returns its manifest."""
        state, m = load_checkpoint(directory, expect=self.identity(), map_location=self.agent.device)
        self.agent.load_state_dict(state)
        self.p = Progress.from_json(m["progress"])
        self.rng.bit_generator.state = m["rng"]["warmup"]
        self.replay.set_rng_state(m["rng"]["replay"])
        self.env.set_random_state(m["rng"]["env"])
        src = self.replay_dir if m["replay"]["external"] else Path(directory) / "replay"
        self.replay.load_incremental(src, m["replay"]["added"])
        self.resumed_from = m["env_steps"]
        return m

    # ---- time ------------------------------------------------------------------------------------
    def wall_s(self) -> float:
        """Real time inside :meth:`run` so far, over every start of this run (resumes add up)."""
        if self._t_start is None:
            return self.p.wall_s
        return self._wall_base + time.perf_counter() - self._t_start

    def _flush_phase_time(self) -> None:
        """Books the time since the last mark to warm-up or training, whichever the decisions since were."""
        now = time.perf_counter()
        if self.p.decisions <= self.spec.train.warmup_decisions:
            self.p.warmup_s += now - self._t_mark
        else:
            self.p.train_s += now - self._t_mark
        self._t_mark = now

    def eta_s(self) -> float | None:
        """Seconds to the end of the run at the costs measured so far (see :func:`remaining_s`)."""
        t, p = self.spec.train, self.p
        warm_done = min(p.decisions, t.warmup_decisions)
        return remaining_s(t, p.decisions, len(p.evals),
                           p.warmup_s / warm_done if warm_done and p.warmup_s > 0 else None,
                           p.train_s / (p.decisions - t.warmup_decisions) if p.decisions > t.warmup_decisions
                           and p.train_s > 0 else None,
                           p.eval_s / len(p.evals) if p.evals and p.eval_s > 0 else None)

    def _beat(self) -> None:
        self._flush_phase_time()
        t = self.spec.train
        self.heartbeat({"env_steps": self.p.decisions * t.frame_skip, "total_env_steps": t.env_steps,
                        "warmup": self.p.decisions < t.warmup_decisions, "eta_s": self.eta_s(),
                        "wall_s": self.wall_s()})

    # ---- loop ------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Trains to ``spec.train.env_steps``; returns the final summary. Raises DivergenceError on NaN/inf.

        With a ``heartbeat``, it is called at the start and then every ``heartbeat_s`` seconds between
        evaluations with ``{env_steps, total_env_steps, warmup, eta_s, wall_s}``.
        """
        self._wall_base, self._t_start = self.p.wall_s, time.perf_counter()
        self._t_mark = self._t_start
        try:
            self._loop()
        finally:  # a stopped run (divergence) still reports its real wall time
            self.p.wall_s, self._t_start = self.wall_s(), None
        return self.summary()

    def _loop(self) -> None:
        t = self.spec.train
        apply_matmul_precision(self.precision)  # FP32 for every critic pass feeding QED or the TD target, unless tf32
        obs = None  # episodes start lazily so a checkpoint taken at an episode end holds the pre-reset env RNG
        ep_return = 0.0
        interval_start = time.perf_counter()
        interval_updates = 0
        last_beat = time.perf_counter()
        if self.heartbeat is not None:
            self._beat()
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
            if keeps_transition(t, self.spec.seed, self.p.decisions, step.truncated):
                self.replay.add(obs, action, step.reward, step.obs, step.terminated)
            ep_return += step.reward
            obs = step.obs
            self.p.decisions += 1
            if self.p.decisions > t.warmup_decisions:
                interval_updates += self._update(env_steps)
            elif self.p.decisions == t.warmup_decisions:
                self._flush_phase_time()  # the cheap warm-up decisions end here
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
                last_beat = interval_start
            elif self.heartbeat is not None and self.p.decisions % 100 == 0 \
                    and time.perf_counter() - last_beat >= self.heartbeat_s:
                last_beat = time.perf_counter()
                self._beat()

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
        self._flush_phase_time()
        t0 = time.perf_counter()
        ev = rollout(self.agent.act_batch, self.spec.task, eval_seeds(t.eval_episodes), frame_skip=t.frame_skip)
        eval_s = time.perf_counter() - t0
        mean = float(ev.returns.mean())
        interval = self._acc.means()
        self.p.evals.append(EvalRecord(env_steps, mean, interval.get("alpha/actor_mean", math.nan),
                                       interval.get("q/abs_diff_mean", math.nan)))
        metrics = {
            "env_steps": env_steps, "decisions": self.p.decisions, "updates": self.p.updates,
            "episodes": self.p.episodes,
            "eval/return_mean": mean, "eval/return_std": float(ev.returns.std()),
            "eval/return_min": float(ev.returns.min()), "eval/return_max": float(ev.returns.max()),
            "perf/updates_per_s": interval_updates / max(elapsed, 1e-9),
            "perf/env_steps_per_s": t.eval_every / max(elapsed, 1e-9), "perf/eval_s": eval_s,
            "perf/wall_s": self.wall_s(),
        }
        if self.p.train_returns:
            metrics["train/episode_return"] = float(np.mean(self.p.train_returns))
        metrics.update(interval)
        self.p.train_returns = []
        # The eval time includes this report (checkpoint, snapshot, logging) only from the next evaluation on:
        # the checkpoint written here must already hold the count of evaluations it belongs to.
        self.p.eval_s += time.perf_counter() - t0
        metrics["perf/eta_s"] = self.eta_s() if self.p.decisions < t.decisions else 0.0
        self.last_metrics = metrics
        for warning in self.agent.report_warnings(metrics):
            self.log(f"WARNING {self.spec.name} at env step {env_steps}: {warning}")
        t_report = time.perf_counter()
        self.reporter(metrics, self.save)
        self.p.eval_s += time.perf_counter() - t_report
        self._t_mark = time.perf_counter()
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
            "updates": self.p.updates, "wall_s": self.p.wall_s, "warmup_s": self.p.warmup_s,
            "train_s": self.p.train_s, "eval_s": self.p.eval_s, "precision": self.precision,
            "updates_per_s": self.p.updates / self.p.train_s if self.p.train_s else math.nan,
            "final_eval_return_mean": evals[-1].return_mean if evals else math.nan,
            "final_eval_return_std": last.get("eval/return_std", math.nan),
            "alpha_mean_over_training": float(np.mean(alphas)) if alphas else math.nan,
            "final_alpha": {k.removeprefix("alpha/"): v for k, v in last.items() if k.startswith("alpha/")},
            "evals": [e.to_json() for e in evals],
        }


def build_trainer(spec: RunSpec, reporter: Reporter, replay_dir: Path | None,
                  log: Callable[[str], None] = print, heartbeat: Callable[[dict], None] | None = None,
                  heartbeat_s: float = 30.0) -> Trainer:
    """Builds env, agent, replay, RNG and device for ``spec`` and injects them into a :class:`Trainer`."""
    torch.set_num_threads(spec.train.threads)
    device = resolve_device(spec.train.device)
    env = make_env(spec.task, spec.seed, spec.train.frame_skip)
    agent = make_agent(spec.agent, spec.temperature, env.obs_dim, env.action_dim, device, spec.seed)
    capacity = spec.train.replay_capacity or spec.train.decisions
    # Independent streams for the buffer sampler and warm-up actions, derived from the run seed.
    replay_rng, warmup_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(spec.seed).spawn(2))
    replay = ReplayBuffer(capacity, env.obs_dim, env.action_dim, replay_rng)
    return Trainer(spec, env, agent, replay, reporter, warmup_rng, replay_dir, log, heartbeat, heartbeat_s)
