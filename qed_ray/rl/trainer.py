"""The training loop: the S >= 1 seeds of one (task, agent, variant) in one process, in lock-step (a single run is a
pack of one; a pack by shape also holds several values of the temperature's member scalars, QED's k say; docs/design.md,
"The training loop")."""

from __future__ import annotations

import math
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from qed_ray.rl.agents.packed import PackedAgent
from qed_ray.rl.agents import make_packed_agent
from qed_ray.spec.config import RunSpec
from qed_ray.rl.env_pool import EnvPool
from qed_ray.rl.evaluate import eval_seeds, rollout_lockstep
from qed_ray.records.manifests import PackRecord
from qed_ray.rl.pack import PackState, Progress, SeedRun, check_pack, pack_name, remaining_s, sampler_seeds
from qed_ray.rl.pack_checkpoint import PackCheckpoints
from qed_ray.rl.update import PackUpdater, resolve_mode
from qed_ray.rl.precision import apply_matmul_precision, set_run_precision
from qed_ray.rl.replay import Replay, keeps_transition, replay_bytes, replay_capacity, replay_device
from qed_ray.rl.update_metrics import MetricAccumulator
from qed_ray.records.writer import BackgroundWriter
from qed_ray.records.run import EvalRecord, RunSummary

HEARTBEAT_EVERY = 100  # decisions between looks at the clock for a heartbeat


class SaveFn(Protocol):
    """``save(folder)`` writes the pack checkpoint; ``save(folder, modules=names, index=i)`` a policy snapshot of
    seed i. Both return the writer's future (the files exist once it is done)."""

    def __call__(self, directory: Path, modules: Sequence[str] | None = None, index: int | None = None
                 ) -> Future: ...


class Reporter(Protocol):
    """Receives, at each evaluation, ``{pack index: metrics}`` of the seeds still training, and ``save``."""

    def __call__(self, metrics: dict[int, dict[str, float]], save: SaveFn) -> None: ...


class InjectedCrash(RuntimeError):
    """Raised by ``train.debug.crash_at_env_step`` (fault-injection tests)."""


class DeviceError(ValueError):
    """``train.device`` names a CUDA device this process does not have; the message is one line."""


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when available (the device Ray assigned via CUDA_VISIBLE_DEVICES), else CPU; ``cuda`` or
    ``cuda:N`` without such a device raises :class:`DeviceError` (before anything is built on it)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
            why = "no CUDA device is visible to this process" if built else \
                f"this torch ({torch.__version__}) is built without CUDA"
        elif (device.index or 0) >= torch.cuda.device_count():
            why = f"only {torch.cuda.device_count()} CUDA device(s) are visible (cuda:0..)"
        else:
            return device
        raise DeviceError(f"train.device: {name!r} asks for CUDA, but {why}; use 'auto' (CUDA when available, "
                          f"else CPU) or 'cpu' (--device on the command line)")
    return device


class Trainer:
    """Runs the S runs of a pack (one :class:`SeedRun` each, in pack order) to their budget.

    ``pool`` holds S training envs (indices 0..S-1), then S x E evaluation envs; ``replay_dirs``: per seed, where its
    replay chunks persist (None: inside each checkpoint); ``heartbeat`` is called at the start and every
    ``heartbeat_s`` seconds between evaluations with ``{env_steps, total_env_steps, warmup, eta_s, wall_s}``.
    """

    def __init__(self, runs: list[SeedRun], pool: EnvPool, agent: PackedAgent, replay: Replay, reporter: Reporter,
                 writer: BackgroundWriter, replay_dirs: Sequence[Path] | None = None,
                 log: Callable[[str], None] = lambda s: None, name: str | None = None,
                 heartbeat: Callable[[dict], None] | None = None, heartbeat_s: float = 30.0):
        self.pool, self.agent, self.replay = pool, agent, replay
        self.reporter, self.writer, self.log = reporter, writer, log
        self.heartbeat, self.heartbeat_s = heartbeat, heartbeat_s
        self.t, self.n = runs[0].spec.train, len(runs)
        self.state = PackState(name or pack_name([r.spec for r in runs]), runs, self.t)
        self.checkpoints = PackCheckpoints(self.state, agent, replay, pool, writer, replay_dirs, self.times)
        self._wall_base, self._t_start, self._t_mark = 0.0, None, time.perf_counter()  # _t_start: set in run()
        self._cpu_base, self._cpu_start = None, (0.0, 0.0)  # cpu_s before run(); (own, workers') CPU at its start
        self.acc = MetricAccumulator(agent.metric_layout, agent.device, seeds=self.n)
        mode, why = resolve_mode(self.t.compile, agent.device, agent,
                                 (self.t.decisions - self.t.warmup_decisions) * agent.spec.utd)
        self.precision, why_p = set_run_precision(agent.template.fn, self.t.precision, agent.device, mode)
        self.update_mode = mode
        self.updater = PackUpdater(agent, replay, self.acc, mode, agent.spec.batch_size)
        log(f"pack {self.state.name}: update mode {mode} ({why}); precision {self.precision} ({why_p})")
        self.eval_index = self.n + np.arange(self.n * self.t.eval_episodes).reshape(self.n, -1)

    @property
    def runs(self) -> list[SeedRun]:
        return self.state.runs

    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def active(self) -> np.ndarray:
        return self.state.active

    # ---- loop --------------------------------------------------------------------------------------------
    def run(self) -> list[RunSummary]:
        """Trains every seed to the budget (or until it diverges); returns the per-seed summaries. The checkpoint
        writes are flushed before it returns or raises, and a stopped run still counts its real wall time (its CPU
        time is then unknown: an env worker's reply may be left unread)."""
        self._cpu_base, self._cpu_start = self.progress.cpu_s, (time.process_time(), self.pool.workers_cpu_s())
        self._wall_base, self._t_start = self.progress.wall_s, time.perf_counter()
        self._t_mark, cpu = self._t_start, None
        try:
            self._loop()
            for run in self.runs:
                run.status = self.state.status(run)
            cpu = self.cpu_s()
        finally:
            self.progress.wall_s, self.progress.cpu_s, self._t_start = self.wall_s(), cpu, None
            self.writer.flush()
        return self.summaries()

    def _loop(self) -> None:
        t = self.t
        apply_matmul_precision(self.precision)  # FP32 for every critic pass feeding QED or the TD target, unless tf32
        obs = np.zeros((self.n, self.pool.obs_dim), np.float32)
        fresh = np.ones(self.n, bool)  # episodes start lazily (a checkpoint at an episode end holds the env RNG)
        interval_start, interval_updates = time.perf_counter(), 0
        last_beat = time.perf_counter()
        if self.heartbeat is not None:
            self._beat()
        while self.progress.decisions < t.decisions and self.active.any():
            env_steps = (self.progress.decisions + 1) * t.frame_skip
            if env_steps == t.debug.crash_at_env_step and self.state.resumed_from is None:
                raise InjectedCrash(f"injected crash at env step {env_steps}")
            on = np.flatnonzero(self.active)
            starting = on[fresh[on]]
            if len(starting):
                obs[starting], fresh[starting] = self.pool.reset(starting), False
            obs, done = self._decide(obs, on, env_steps)
            self.progress.decisions += 1
            if self.progress.decisions > t.warmup_decisions:
                interval_updates += self._update(env_steps)
            elif self.progress.decisions == t.warmup_decisions:
                self._flush_phase_time()  # the cheap warm-up decisions end here
            for i in np.flatnonzero(done & self.active):
                run = self.runs[i]
                run.train_returns.append(run.ep_return)
                run.episodes, run.ep_return, fresh[i] = run.episodes + 1, 0.0, True
            if self.progress.decisions % t.nan_check_every == 0:
                self._check_finite(env_steps)
            if self.progress.decisions % t.eval_every_decisions == 0:
                self._evaluate_and_report(env_steps, time.perf_counter() - interval_start, interval_updates)
                interval_start, interval_updates = time.perf_counter(), 0
                last_beat = interval_start
            elif self.heartbeat is not None and self.progress.decisions % HEARTBEAT_EVERY == 0 \
                    and time.perf_counter() - last_beat >= self.heartbeat_s:
                last_beat = time.perf_counter()
                self._beat()

    def _decide(self, obs: np.ndarray, on: np.ndarray, env_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Acts, steps the active envs, stores their transitions; returns (next obs, episode ended) [S]."""
        if self.progress.decisions < self.t.warmup_decisions:
            actions = np.zeros((self.n, self.pool.action_dim), np.float32)
            for i in on:
                actions[i] = self.runs[i].warmup_rng.uniform(-1.0, 1.0, self.pool.action_dim).astype(np.float32)
        else:
            actions = self.agent.act(obs, self.active)
            # The actions are on the host already (for env.step): a NaN/inf one stops its seed like a NaN loss,
            # before its env is stepped with it.
            for i in on[~np.isfinite(actions[on]).all(axis=1)]:
                self._stop(i, f"non-finite action at env step {env_steps}")
            on = on[self.active[on]]
        step = self.pool.step(on, actions[on])
        nxt, reward, terminated, done = obs.copy(), np.zeros(self.n), np.zeros(self.n, bool), np.zeros(self.n, bool)
        nxt[on], reward[on], terminated[on], done[on] = step.obs, step.reward, step.terminated, \
            step.terminated | step.truncated
        for i in on[~np.isfinite(step.obs).all(axis=1)]:
            self._stop(i, f"non-finite observation at env step {env_steps}")
        truncated = done & ~terminated
        keep = [keeps_transition(self.t, run.spec.seed, self.progress.decisions, bool(truncated[i]))
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
            self.progress.updates += 1
        return self.agent.spec.utd

    def _check_finite(self, env_steps: int) -> None:
        bad = self.acc.non_finite_per_seed(("loss/", "q/"))  # one sync
        for i in np.flatnonzero(self.active):
            if bad[i]:
                self._stop(i, f"non-finite {', '.join(bad[i])} by env step {env_steps} (decision "
                              f"{self.progress.decisions}, update {self.progress.updates})")

    def _stop(self, i: int, reason: str) -> None:
        run = self.runs[i]
        self.state.stop(i, reason, (self.progress.decisions, self.progress.updates))
        self.agent.freeze(i)
        others = " (the other seeds of the pack go on)" if self.active.any() else ""
        self.log(f"{run.name} stopped{others}: {reason}")

    # ---- time ------------------------------------------------------------------------------------
    def wall_s(self) -> float:
        """Real time inside :meth:`run` so far, over every start of this pack (resumes add up)."""
        if self._t_start is None:
            return self.progress.wall_s
        return self._wall_base + time.perf_counter() - self._t_start

    def cpu_s(self) -> float | None:
        """CPU time this process and its env workers used inside :meth:`run` so far, over every start (None: a start
        recorded none, as a pack resumed from a checkpoint written before it was measured)."""
        if self._t_start is None or self._cpu_base is None:
            return self.progress.cpu_s
        own, workers = self._cpu_start
        return self._cpu_base + time.process_time() - own + self.pool.workers_cpu_s() - workers

    def times(self) -> dict[str, float | None]:
        """``{"wall_s", "cpu_s"}`` so far (what checkpoints and snapshots record)."""
        return {"wall_s": self.wall_s(), "cpu_s": self.cpu_s()}

    def _flush_phase_time(self) -> None:
        """Books the time since the last mark to warm-up or training, whichever the decisions since were."""
        now = time.perf_counter()
        if self.progress.decisions <= self.t.warmup_decisions:
            self.progress.warmup_s += now - self._t_mark
        else:
            self.progress.train_s += now - self._t_mark
        self._t_mark = now

    def eta_s(self) -> float | None:
        """Seconds to the end of the run at the costs measured so far (see :func:`~qed_ray.rl.pack.remaining_s`)."""
        t, p = self.t, self.progress
        warm_done, evals = min(p.decisions, t.warmup_decisions), p.decisions // t.eval_every_decisions
        return remaining_s(t, p.decisions, evals,
                           p.warmup_s / warm_done if warm_done and p.warmup_s > 0 else None,
                           p.train_s / (p.decisions - t.warmup_decisions) if p.decisions > t.warmup_decisions
                           and p.train_s > 0 else None,
                           p.eval_s / evals if evals and p.eval_s > 0 else None)

    def _beat(self) -> None:
        self._flush_phase_time()
        t = self.t
        self.heartbeat({"env_steps": self.progress.decisions * t.frame_skip, "total_env_steps": t.env_steps,
                        "warmup": self.progress.decisions < t.warmup_decisions, "eta_s": self.eta_s(),
                        "wall_s": self.wall_s()})

    # ---- evaluation ------------------------------------------------------------------------------
    def _evaluate_and_report(self, env_steps: int, elapsed: float, interval_updates: int) -> None:
        self._check_finite(env_steps)
        self._flush_phase_time()
        if not self.active.any():  # the check stopped the last active seed: nothing to evaluate or report
            return
        t0 = time.perf_counter()
        returns = rollout_lockstep(self.agent.act_deterministic, self.pool, self.eval_index,
                                   eval_seeds(self.t.eval_episodes), self.active).returns
        eval_s = time.perf_counter() - t0
        interval = self.acc.means_per_seed()
        # The eval time includes this report (checkpoint, snapshot, logging) only from the next evaluation on:
        # the checkpoint written here must already hold the count of evaluations it belongs to.
        self.progress.eval_s += eval_s
        eta = self.eta_s() if self.progress.decisions < self.t.decisions else 0.0
        cpu = self.cpu_s()
        metrics = {int(i): self._metrics(self.runs[i], returns[i], interval[i], env_steps, elapsed,
                                         interval_updates, eval_s, eta, cpu) for i in np.flatnonzero(self.active)}
        t_report = time.perf_counter()
        self.reporter(metrics, self.checkpoints.save)
        self.progress.eval_s += time.perf_counter() - t_report
        self._t_mark = time.perf_counter()
        for i, m in metrics.items():
            self.log(f"{self.runs[i].name} env_steps={env_steps} eval={m['eval/return_mean']:.1f} "
                     f"alpha={m.get('alpha/actor_mean', float('nan')):.4f} ups={m['perf/updates_per_s']:.1f}")

    def _metrics(self, run: SeedRun, returns: np.ndarray, interval: dict, env_steps: int, elapsed: float,
                 interval_updates: int, eval_s: float, eta: float | None, cpu: float | None) -> dict[str, float | None]:
        """One seed's evaluation metrics."""
        mean = float(returns.mean())
        run.evals.append(EvalRecord(env_steps=env_steps, return_mean=mean,
                                    alpha_mean=interval.get("alpha/actor_mean", math.nan),
                                    q_gap_mean=interval.get("q/abs_diff_mean", math.nan)))
        metrics = {
            "env_steps": env_steps, "decisions": self.progress.decisions, "updates": self.progress.updates,
            "episodes": run.episodes, "eval/return_mean": mean, "eval/return_std": float(returns.std()),
            "eval/return_min": float(returns.min()), "eval/return_max": float(returns.max()),
            "perf/updates_per_s": interval_updates / max(elapsed, 1e-9),
            "perf/env_steps_per_s": self.t.eval_every / max(elapsed, 1e-9), "perf/eval_s": eval_s,
            "perf/wall_s": self.wall_s(), "perf/cpu_s": cpu, "perf/eta_s": eta,
        }
        if run.train_returns:
            metrics["train/episode_return"] = float(np.mean(run.train_returns))
        metrics.update(interval)
        run.train_returns, run.last_metrics = [], metrics
        for warning in self.agent.template.report_warnings(metrics):
            self.log(f"WARNING {run.name} at env step {env_steps}: {warning}")
        return metrics

    # ---- checkpoints and results ----------------------------------------------------------------------
    def restore(self, directory: Path) -> PackRecord:
        """Loads a pack checkpoint (:class:`~qed_ray.rl.pack_checkpoint.PackCheckpoints`); returns its pack.json."""
        return self.checkpoints.restore(directory)

    def summaries(self) -> list[RunSummary]:
        """Per seed, its final figures (``summary.json``; ``reason`` when it diverged)."""
        return [self._summary(run) for run in self.runs]

    def _summary(self, run: SeedRun) -> RunSummary:
        s, t, p = run.spec, self.t, self.progress
        decisions, updates = run.stopped_at or (p.decisions, p.updates)
        alphas = [e.alpha_mean for e in run.evals if math.isfinite(e.alpha_mean)]
        last = run.last_metrics
        return RunSummary(
            name=run.name, task=s.task, agent=s.agent.name, variant=s.variant, seed=s.seed,
            status=self.state.status(run), env_steps=decisions * t.frame_skip, decisions=decisions, updates=updates,
            pack_size=self.n, precision=self.precision, update_mode=self.update_mode, wall_s=p.wall_s,
            warmup_s=p.warmup_s, train_s=p.train_s, eval_s=p.eval_s, cpu_s=p.cpu_s,
            updates_per_s=p.updates / p.train_s if p.train_s else math.nan,
            final_eval_return_mean=run.evals[-1].return_mean if run.evals else math.nan,
            final_eval_return_std=last.get("eval/return_std", math.nan),
            alpha_mean_over_training=float(np.mean(alphas)) if alphas else math.nan,
            final_alpha={k.removeprefix("alpha/"): v for k, v in last.items() if k.startswith("alpha/")},
            evals=list(run.evals), reason=run.reason)

    def close(self) -> None:
        """Flushes the writer and frees the envs (and their workers)."""
        try:
            self.writer.flush()
        finally:
            self.pool.close()


def _streams(seed: int) -> list[np.random.Generator]:
    """A run seed's two independent numpy streams: its replay sampler and its warm-up actions."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2)]


def build_trainer(specs: Sequence[RunSpec], reporter: Reporter, replay_dirs: Sequence[Path] | None,
                  names: Sequence[str] | None = None, env_workers: int = 0, log: Callable[[str], None] = print,
                  writer: BackgroundWriter | None = None, pack: str | None = None,
                  heartbeat: Callable[[dict], None] | None = None, heartbeat_s: float = 30.0) -> Trainer:
    """Builds the envs, the pack's agent, replay, per-seed random streams and the writer for ``specs`` (in pack
    order, checked by :func:`~qed_ray.rl.pack.check_pack`) and injects them into a :class:`Trainer`. Seed s's
    streams are derived from s alone, so a member trains alike whatever pack it is in (except its replay sampler
    with ``train.shared_indices``: :func:`~qed_ray.rl.pack.sampler_seeds`)."""
    check_pack(specs)
    spec, t = specs[0], specs[0].train
    torch.set_num_threads(t.threads)
    device = resolve_device(t.device)
    seeds = [s.seed for s in specs]
    env_seeds = seeds + eval_seeds(t.eval_episodes) * len(seeds)  # eval envs are reseeded before every use
    pool = EnvPool(spec.task, env_seeds, t.frame_skip, env_workers)
    agent = make_packed_agent(spec.agent, [s.temperature for s in specs], pool.obs_dim, pool.action_dim, device, seeds)
    capacity = replay_capacity(t)
    nbytes = replay_bytes(len(seeds), capacity, pool.obs_dim, pool.action_dim)
    replay = Replay(capacity, pool.obs_dim, pool.action_dim, [_streams(s)[0] for s in sampler_seeds(specs)], device,
                    replay_device(device, nbytes))
    runs = [SeedRun(s, n, _streams(s.seed)[1]) for s, n in zip(specs, names or [s.name for s in specs])]
    log(f"pack {pack or pack_name(specs)}: {len(seeds)} seed{'s' if len(seeds) > 1 else ''} on {device}, replay "
        f"{nbytes / 2**20:.1f} MiB on {replay.storage.device}, {env_workers} env workers")
    return Trainer(runs, pool, agent, replay, reporter, writer or BackgroundWriter(), replay_dirs, log, pack,
                   heartbeat, heartbeat_s)
