"""Benchmark: does an agent with its DEFAULT architecture learn a task within a budget?

Each (temperature, seed) run trains through ``qed_ray.rl.trainer.build_trainer`` (a pack of one) exactly as the CLI would, with
only the budget and evaluation cadence changed. By default a run stops at the first evaluation whose mean
return reaches ``--threshold`` (enough to answer "reaches 800 within 100k env steps" and it saves CPU);
``--no-stop-at-threshold`` runs every curve to the budget. Runs go in parallel worker processes.

Run: ``MUJOCO_GL=disable .venv/bin/python benchmarks/bench_learning.py --agent sac_ln --temperatures te qed0.2
--seeds 0 1 2``. Prints one line per evaluation, a table per (temperature, seed) and a verdict per temperature;
writes everything to ``--out``/learning_<agent>_<task>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pydantic import ValidationError

from qed_ray.spec.config import TemperatureSpec
from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.naming import parse_variant


def parse_temperature(label: str) -> dict:
    """A temperature label (``te``, ``qed0.2``, ``fixed0.1``, ``qed0.2+alpha_max=0.3``) as TemperatureSpec settings.

    Uses the project's one label/parse pair (:func:`qed_ray.spec.naming.parse_variant`); argparse turns a bad label
    into a usage error.
    """
    try:
        parsed = parse_variant(label)
        if parsed["agent"] or parsed["train"]:
            raise ValueError("only temperature settings belong in a temperature label")
        spec = TemperatureSpec.model_validate(parsed["temperature"])
        return {"kind": spec.kind, **spec.model_dump(exclude_defaults=True)}
    except ValidationError as e:
        raise argparse.ArgumentTypeError(f"temperature {label!r}: {format_validation_error(e)}") from None
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"temperature {label!r}: {e}") from None


class _ThresholdReached(Exception):
    """Raised by the reporter to end a run early once the threshold is met."""


class _Recorder:
    """Reporter that keeps each evaluation's metrics, prints a line and optionally stops at the threshold."""

    def __init__(self, name: str, threshold: float, stop: bool, budget: int):
        self.name, self.threshold, self.stop, self.budget = name, threshold, stop, budget
        self.evals: list[dict] = []
        self.t0 = time.perf_counter()

    def __call__(self, metrics: dict, save) -> None:
        # ``save`` is ignored: the benchmark never checkpoints (no resume needed, no disk churn).
        self.evals.append(dict(metrics))
        ret = metrics["eval/return_mean"]
        print(f"{self.name} [{int(metrics['env_steps']):>7,d}/{self.budget:,d}] eval {ret:7.1f} "
              f"± {metrics['eval/return_std']:5.1f}  alpha {metrics.get('alpha/actor_mean', math.nan):.4f}  "
              f"{metrics['perf/updates_per_s']:6.1f} upd/s  {time.perf_counter() - self.t0:6.0f} s", flush=True)
        if self.stop and ret >= self.threshold:
            raise _ThresholdReached


def summarise(evals: list[dict], threshold: float) -> dict:
    """Threshold crossing, final/best return and mean alpha over the evaluations of one run.

    Args:
        evals: the reporter's metrics dicts, in order.
        threshold: return to reach.

    Returns:
        dict with ``reached_at`` (env steps or None), ``return_at_reach``, ``final_return``, ``best_return`` and
        ``alpha_mean`` (mean of ``alpha/actor_mean`` over evaluations that had updates; NaN if none did).
    """
    returns = [e["eval/return_mean"] for e in evals]
    first = next((e for e in evals if e["eval/return_mean"] >= threshold), None)
    # Evaluations inside the uniform warm-up carry no alpha (no update ran yet), so they are skipped.
    alphas = [e["alpha/actor_mean"] for e in evals if "alpha/actor_mean" in e]
    return {
        "reached_at": int(first["env_steps"]) if first else None,
        "return_at_reach": first["eval/return_mean"] if first else None,
        "final_return": returns[-1] if returns else math.nan,
        "best_return": max(returns) if returns else math.nan,
        "alpha_mean": sum(alphas) / len(alphas) if alphas else math.nan,
    }


def run_one(job: dict) -> dict:
    """Trains one (temperature, seed) run in this (worker) process and returns its record.

    Args:
        job: ``spec`` (RunSpec dict), ``threshold`` and ``stop`` (bool).

    Returns:
        the spec, every evaluation's metrics, :func:`summarise`'s figures, ``status`` and ``wall_s``.
    """
    os.environ.setdefault("MUJOCO_GL", "disable")
    from qed_ray.spec.config import RunSpec
    from qed_ray.rl.trainer import build_trainer

    spec = RunSpec.model_validate(job["spec"])
    rec = _Recorder(spec.name, job["threshold"], job["stop"], spec.train.env_steps)
    trainer = build_trainer([spec], lambda metrics, save: rec(metrics[0], save), None, log=lambda line: None)
    status = "budget"
    try:
        (summary,) = trainer.run()
        if summary["status"] == "diverged":
            status = f"diverged: {summary['reason']}"
            print(f"{spec.name} DIVERGED: {summary['reason']}", flush=True)
    except _ThresholdReached:
        status = "stopped_at_threshold"
    finally:
        trainer.close()
    return {"name": spec.name, "variant": spec.variant, "seed": spec.seed, "spec": spec.model_dump(mode="json"),
            "status": status, "wall_s": time.perf_counter() - rec.t0, "evals": rec.evals,
            **summarise(rec.evals, job["threshold"])}


def make_jobs(args: argparse.Namespace) -> list[dict]:
    """One job per (temperature, seed); sizes stay the agent's defaults unless ``--agent-overrides`` is given."""
    jobs = []
    agent = {**json.loads(args.agent_overrides), "name": args.agent}
    for temperature in args.temperatures:
        for seed in args.seeds:
            spec = {"task": args.task, "seed": seed, "agent": agent, "temperature": temperature,
                    "train": {"env_steps": args.env_steps, "eval_every": args.eval_every,
                              "eval_episodes": args.eval_episodes, "threads": 1, "device": "cpu"}}
            jobs.append({"spec": spec, "threshold": args.threshold, "stop": args.stop_at_threshold})
    return jobs


def _fmt(x, spec: str) -> str:
    """Formats a number, or '-' for None/NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_report(results: list[dict], args: argparse.Namespace) -> None:
    """The per-run table and one verdict line per temperature."""
    print(f"\n{args.agent} on {args.task}: threshold {args.threshold:g}, budget {args.env_steps} env steps, "
          f"eval every {args.eval_every} ({args.eval_episodes} episodes)")
    head = f"{'temperature':<11} {'seed':>4} {'first >= thr':>13} {'ret there':>9} {'final':>7} {'best':>7} " \
           f"{'mean alpha':>10} {'wall s':>7}  status"
    print(head)
    print("-" * len(head))
    for r in results:
        reached = f"{r['reached_at']:,d}" if r["reached_at"] is not None else "not reached"
        print(f"{r['variant']:<11} {r['seed']:>4} {reached:>13} {_fmt(r['return_at_reach'], '.1f'):>9} "
              f"{_fmt(r['final_return'], '.1f'):>7} {_fmt(r['best_return'], '.1f'):>7} "
              f"{_fmt(r['alpha_mean'], '.4f'):>10} {r['wall_s']:>7.0f}  {r['status']}")
    for variant in dict.fromkeys(r["variant"] for r in results):
        runs = [r for r in results if r["variant"] == variant]
        hits = sum(r["reached_at"] is not None for r in runs)
        print(f"{args.agent} {variant}: {hits}/{len(runs)} seeds reached >= {args.threshold:g} "
              f"within {args.env_steps} env steps")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--agent", choices=["sac_ln", "mad_sac"], default="sac_ln")
    p.add_argument("--task", default="cartpole-balance")
    p.add_argument("--agent-overrides", default="{}",
                   help='JSON AgentSpec fields, e.g. \'{"hidden": 128, "batch_size": 256}\' (default: none)')
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--temperatures", type=parse_temperature, nargs="+", default=["te", "qed0.2"],
                   help="te, qedK or fixedA")
    p.add_argument("--env-steps", type=int, default=100_000)
    p.add_argument("--eval-every", type=int, default=5000)
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--threshold", type=float, default=800.0)
    p.add_argument("--stop-at-threshold", action=argparse.BooleanOptionalAction, default=True,
                   help="stop a run at its first evaluation with mean return >= threshold")
    p.add_argument("--workers", type=int, default=2, help="parallel runs (processes, one torch thread each)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/learning"))
    args = p.parse_args(argv)
    # argparse applies ``type`` to string defaults too, but keep the conversion explicit for list defaults.
    args.temperatures = [t if isinstance(t, dict) else parse_temperature(t) for t in args.temperatures]
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs every job in a spawn-context process pool, prints the report and writes the JSON."""
    args = parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")
    jobs = make_jobs(args)
    t0 = time.perf_counter()
    # spawn: forked children would inherit torch/MuJoCo state of the parent; spawn gives clean processes.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        results = list(pool.map(run_one, jobs))
    total = time.perf_counter() - t0
    print_report(results, args)
    print(f"total wall time {total:.0f} s with {args.workers} workers")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"learning_{args.agent}_{args.task}.json"
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    path.write_text(json.dumps({"settings": settings, "total_wall_s": total, "runs": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
