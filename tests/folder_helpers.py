"""Sweep folders built by hand for the gather, re-analysis and status tests: real policy snapshots of untrained tiny
agents where a sweep writes them, DONE markers, and a real SQLite MLflow store with the signed digests trials record
(under the tests' results key, conftest.py)."""

from __future__ import annotations

import json
import math

import torch
from kit import TRAIN

from qed_ray.rl.agents import make_agent
from qed_ray.records.checkpoint import new_manifest, save_checkpoint
from qed_ray.records.digests import inventory, record
from qed_ray.rl.run_folder import write_done
from qed_ray.spec.config import RunSpec
from qed_ray.records.layout import SweepDir, TrialId
from qed_ray.spec.sweep import FinalEvalSpec

SWEEP_ID = "0123456789ab"
# The final evaluation the hand-built sweep "ran" with (its parent run's params; the re-analysis tests' settings).
SWEEP_FINAL_EVAL = {"episodes": 1, "action_rollouts": 1, "action_steps": 10, "curve_episodes": 1, "bootstrap_reps": 100}
TEMPERATURES = {"te": {"kind": "te"}, "qed0.2": {"kind": "qed", "k": 0.2}}
BUDGET, EVAL_EVERY = 2000, 1000
# The hand-built folder's sweep spec over kit's sweep (kit.sweep_spec(TEMPLATE_SWEEP, storage_path=...)).
TEMPLATE_SWEEP = {"name": "sweep", "agents": [{"name": "sac_ln", "overrides": {"hidden": 16},
                                              "temperatures": list(TEMPERATURES.values())}],
                  "train": {**TRAIN, "env_steps": BUDGET, "eval_every": EVAL_EVERY}, "final_eval": SWEEP_FINAL_EVAL}


def run_spec(name: str) -> RunSpec:
    """The RunSpec a trial of this name would have (tiny actor and critics)."""
    t = TrialId.from_name(name)
    return RunSpec.model_validate({"task": t.task, "seed": t.seed, "agent": {"hidden": 16},
                                   "temperature": TEMPERATURES[t.variant],
                                   "train": {"env_steps": BUDGET, "eval_every": EVAL_EVERY}})


def evals_until(step: int, seed: int) -> list[dict]:
    """An evaluation history up to ``step``: returns 100 * (eval index + seed), critic gap 0.1 * (index + 1)."""
    return [{"env_steps": s, "return_mean": 100.0 * (i + 1 + seed), "alpha_mean": 0.1, "q_gap_mean": 0.1 * (i + 1)}
            for i, s in enumerate(range(EVAL_EVERY, step + 1, EVAL_EVERY))]


def save_snapshot(layout: SweepDir, name: str, step: int, init_seed: int, cpu_s: float | None = None) -> None:
    """A policy snapshot at ``step`` as the trainer writes it: weights from ``init_seed``, history, wall time (and
    ``cpu_s``; None: as a qed_ray that did not measure it wrote it)."""
    spec = run_spec(name)
    agent = make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), init_seed)
    seed = TrialId.from_name(name).seed
    save_checkpoint(layout.snapshot(name, step), {k: m.state_dict() for k, m in agent.modules().items()},
                    new_manifest(task=spec.task, agent=spec.agent.name, variant=spec.variant, seed=seed, obs_dim=5,
                                 action_dim=1, env_steps=step, run=spec, policy_only=True,
                                 modules=sorted(agent.modules()), evals=evals_until(step, seed),
                                 wall_s=10.0 * step / EVAL_EVERY, cpu_s=cpu_s))


def seed_checkpoint(folder, name: str, step: int, wall_s: float, pack_size: int = 1, index: int = 0,
                    cpu_s: float | None = None) -> None:
    """A seed's part of a pack checkpoint as the trainer writes it (weights of an untrained tiny agent, real random
    stream states, ``wall_s`` and ``cpu_s`` so far), at ``step`` env steps."""
    import numpy as np

    spec = run_spec(name)
    agent = make_agent(spec.agent, spec.temperature, 5, 1, torch.device("cpu"), 0)
    pcg = np.random.default_rng(0).bit_generator.state
    mt = {"name": "MT19937", "keys": [1] * 624, "pos": 624, "has_gauss": 0, "cached": 0.0}
    save_checkpoint(folder, agent.state_dict(), new_manifest(
        task=spec.task, agent=spec.agent.name, variant=spec.variant, seed=spec.seed, obs_dim=5, action_dim=1,
        env_steps=step, run=spec, progress={"decisions": step // 2, "updates": 0, "episodes": 0, "wall_s": wall_s,
                                            "cpu_s": cpu_s, "evals": evals_until(step, spec.seed)},
        rng={"warmup": pcg, "replay": pcg, "env": mt}, replay={"added": step // 2, "external": True},
        pack="p", pack_size=pack_size, pack_index=index))


def finished_trial(layout: SweepDir, name: str, cpu_s: float | None = None) -> None:
    """Snapshots at every evaluation and the DONE marker of a trial that finished (having used ``cpu_s``; None: as a
    qed_ray that did not measure it wrote them)."""
    seed = TrialId.from_name(name).seed
    for step in range(EVAL_EVERY, BUDGET + 1, EVAL_EVERY):
        save_snapshot(layout, name, step, init_seed=100 * seed + step // EVAL_EVERY,
                      cpu_s=None if cpu_s is None else cpu_s * step / BUDGET)
    cpu = {} if cpu_s is None else {"perf/cpu_s": cpu_s}
    write_done(layout, name, {"env_steps": BUDGET, "perf/wall_s": 20.0, **cpu}, inventory(layout, name))


def new_sweep(layout: SweepDir, finished: list[str], running: dict[str, int]) -> None:
    """``sweep.json``, finished trials, running trials (``name: env steps reached``) and an MLflow store in which
    every finished trial recorded its checksums."""
    from qed_ray.service.mlflow.tracking import Tracker, default_tracking_uri

    layout.root.mkdir(parents=True, exist_ok=True)
    layout.state_file.write_text(json.dumps({"sweep_id": SWEEP_ID, "fingerprint": "x", "created": 0.0}))
    for name in finished:
        finished_trial(layout, name)
    for name, step in running.items():
        save_snapshot(layout, name, step, init_seed=7)
    tracker = Tracker(default_tracking_uri(layout.root), "exp", SWEEP_ID, str(layout.mlartifacts))
    parent = tracker.parent_run("exp", {"final_eval": FinalEvalSpec(**SWEEP_FINAL_EVAL).model_dump(mode="json")}, {})
    for name in [*finished, *running]:
        tracker.trial_run(parent, name, {})
        if name in finished:
            sign_trial(layout, name)


def sign_trial(layout: SweepDir, name: str) -> None:
    """What the trial's worker records at its end: the signed digest of its files, in its MLflow run."""
    from qed_ray.service.results_key import load_key
    from qed_ray.service.mlflow.tracking import Tracker, default_tracking_uri, digest_tags

    key = load_key(create=True).secret
    tracker = Tracker(default_tracking_uri(layout.root), "exp", SWEEP_ID, str(layout.mlartifacts))
    run = tracker.trial_runs()[name].info.run_id
    tracker.set_tags(run, digest_tags(record(key, SWEEP_ID, name, inventory(layout, name))))


def finish_running(layout: SweepDir, name: str) -> None:
    """A running trial of :func:`new_sweep` finishes: its snapshots, DONE marker and signed digest."""
    finished_trial(layout, name)
    sign_trial(layout, name)


def write_history(layout: SweepDir, name: str, floor: list[float], cap: list[float]) -> None:
    """``history.json`` as a trial writes it, with QED's shares of actor-update states at its floor and cap at each
    evaluation (env steps EVAL_EVERY, 2 * EVAL_EVERY, ...); a finished trial's DONE.json and digest then cover it,
    as they would had the trial written it before it finished."""
    entries = [{"time_ms": i, "metrics": {"env_steps": EVAL_EVERY * (i + 1), "alpha/actor_frac_floor": f,
                                          "alpha/actor_frac_cap": c}} for i, (f, c) in enumerate(zip(floor, cap))]
    layout.history(name).write_text(json.dumps(entries))
    if layout.done_marker(name).exists():
        write_done(layout, name, {"env_steps": BUDGET, "perf/wall_s": 20.0}, inventory(layout, name))
        sign_trial(layout, name)


def is_nan(x) -> bool:
    """None (strict JSON's NaN) or a float NaN."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def group_result(task="a", agent="sac_ln", variant="te", scores=(0.1, 0.2), V=1.0, action_distance=5.0,
                 early_q_gap=1.0, q1_dispersion=2.0, **kw):
    """A GroupResult with the given numbers: returns consistent with the scores, D and the action-distance matrix
    constant off the diagonal (so their pair means are V and action_distance), the rest small and fixed."""
    from qed_ray.analysis.results import GroupResult

    n = len(scores)
    seeds = list(range(n))

    def pairs(value):
        return [[0.0 if i == j else value for j in range(n)] for i in range(n)]

    fields = dict(task=task, agent=agent, variant=variant, seeds=seeds, final_env_steps=2000,
                  returns=[[1000 * s, 1000 * s] for s in scores], scores=list(scores), V=V, D=pairs(V),
                  action_distance=action_distance, v_curve=[[1000, 2 * V], [2000, V]], q1_dispersion=q1_dispersion,
                  early_q_gap=early_q_gap, learning_curves={s: [[1000, 10.0], [2000, 20.0]] for s in seeds},
                  action_distance_pairs=pairs(action_distance))
    return GroupResult(**{**fields, **kw})
