"""``python -m qed_ray.sweep SPEC --dry-run``: what a run would do, and what it would cost; starts nothing.

Prints the packs (one Tune trial each) and the trials they train, what a run would do with each from the folder on
disk (``new``, ``start``, ``resume from env step N``, ``done``, ``diverged``), the
resources per Tune trial and all at once, the GPU-hours the grid needs by the measured throughput table
(:mod:`qed_ray.service.throughput`) and the largest replay per trial and per pack against their caps
(:mod:`qed_ray.replay_memory`). A spec that a real run would refuse is refused the same way (exit 2); a tracking
server that does not answer from here is only warned about (:mod:`qed_ray.service.tracking_uri`).

The GPU-hours estimate: per pack, its seed-decisions (seeds x ``train.env_steps / frame_skip``) over the measured
seed-decisions per second of one GPU holding ``1 / resources.gpu`` such packs (so each pack's share of a GPU is
counted once); summed over packs. It counts the measured work only -- acting and the updates -- and ignores env
stepping that the update does not hide, evaluations, checkpoint writes, the gather step, start-up and queueing.
Each pack's cell is read at the precision it would train at on a GPU (``train.precision``, ``auto`` being
:data:`qed_ray.rl.precision.CUDA_DEFAULT`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from qed_ray.layout import SweepDir
from qed_ray.service.packing import Pack
from qed_ray.rl.precision import CUDA_DEFAULT
from qed_ray.spec import SpecError, SweepSpec, Trial
from qed_ray.service.sweep_state import check_folder, plan, resolve_paths
from qed_ray.replay_memory import replay_line
from qed_ray.service.tracking_uri import unreachable, uri_field
from qed_ray.service.throughput import DEFAULT_PATH, SHARE_CELL, Throughput, load_throughput

# A pack's update mode on a GPU by train.compile (auto: graph on CUDA) -> the throughput table's key.
UPDATE_MODES = {"auto": "graph", "graph": "graph", "compile": "compile", "off": "off"}


def dry_run(spec: SweepSpec, throughput_path: str | Path = DEFAULT_PATH) -> int:
    """Prints the plan (see the module notes); raises SpecError with the refusals a run would give."""
    layout, uri, exp = resolve_paths(spec)
    p = plan(check_folder(layout, spec), spec, layout)
    trials = spec.trials()
    res = spec.trial_resources()
    plural = "s" if len(p.packs) > 1 else ""
    print(f"sweep {spec.name}: {len(trials)} trials in {len(p.packs)} pack{plural} (Tune trial{plural}) of up to "
          f"{spec.pack.seeds} seed{'s' if spec.pack.seeds > 1 else ''} -> {layout.root}  (MLflow {uri}, experiment "
          f"{exp})")
    if p.state.get("claim"):
        rec = p.state["claim"]
        print(f"pre-registration: {rec['file']} (claim block sha256 {rec['sha256'][:12]}; frozen in sweep.json at the "
              f"first start, a changed block is refused)")
    for pack in p.packs:
        print(f"  pack {pack.name}  ({len(pack.trials)} seed{'s' if len(pack.trials) > 1 else ''})")
        for t in pack.trials:
            r = t.run
            print(f"    {t.name:48s} env_steps={r.train.env_steps:,} hidden={r.agent.hidden} "
                  f"batch={r.agent.batch_size}  [{_what_next(layout, t, p.new, pack)}]")
    total, n = sum(t.run.train.env_steps for t in trials), len(p.packs)
    print(f"per pack: {res['cpu']:g} CPU ({spec.resources.cpu:g} + {spec.pack.env_workers} env workers), "
          f"{res['gpu']:g} GPU; all {n} packs at once: {res['cpu'] * n:g} CPU, {res['gpu'] * n:g} GPU; total "
          f"env steps {total:,}")
    print(gpu_hours_line(spec, p.packs, load_throughput(throughput_path)))
    print(replay_line(spec.replay_needs()))
    problem = unreachable(uri)
    if problem:  # a cluster-only address is normal where a dry run is made: a start refuses it, this warns
        print(f"warning: {uri_field()}: {problem}; a start from here would be refused (fine if the address is "
              f"reachable only from the cluster's head)", file=sys.stderr)
    if p.problems:
        raise SpecError("\n".join(p.problems))
    return 0


def _what_next(layout: SweepDir, trial: Trial, new: list[str], pack: Pack) -> str:
    if trial.name in new:
        return "new"
    state = layout.trial_state(trial.name)
    if state != "pending":
        return state
    steps = layout.pack_checkpoint_steps(pack.id)
    return f"resume from env step {max(steps):,}" if steps else "start"


def gpu_hours_line(spec: SweepSpec, packs: Sequence[Pack], table: Throughput | None) -> str:
    """One line: the grid's estimated GPU-hours (see the module notes), or why there is none."""
    gpu = spec.resources.gpu
    if gpu == 0:
        return "GPU-hours: none (resources.gpu is 0: the trials run on CPUs)"
    if table is None:
        return "GPU-hours: no GPU measurement yet (qed_ray/data/throughput.json has no GPU table)"
    per_gpu = round(1 / gpu)
    seconds, missing, scaled, modes, precisions = 0.0, [], False, {}, {}
    for run, size in [(p.trials[0].run, len(p.trials)) for p in packs]:
        mode = UPDATE_MODES[run.train.compile]
        precision = CUDA_DEFAULT if run.train.precision == "auto" else run.train.precision  # on a GPU
        modes[mode], precisions[precision] = None, None
        # A fixed alpha runs te's passes without its one-scalar alpha step, so it is timed as te.
        kind = "te" if run.temperature.kind == "fixed" else run.temperature.kind
        rate = table.shared_rate(run.agent.name, kind, size, per_gpu, mode, precision)
        if rate is None:
            missing.append(f"{run.agent.name}/{kind} S={size}" + (f" {precision}" if precision != "fp32" else ""))
            continue
        seconds += size * run.train.decisions / rate[0]
        scaled |= rate[1]
    where = f"{table.card}, measured {table.date}, {per_gpu} pack(s) per GPU, mode {'/'.join(modes)}"
    if list(precisions) != ["fp32"]:
        where += f", precision {'/'.join(precisions)}"
    if scaled:
        where += f"; sharing scaled from {'/'.join(map(str, SHARE_CELL))}"
    if missing:
        cells = ", ".join(dict.fromkeys(missing))
        return f"GPU-hours: unknown: the throughput table ({where}) has no entry for {cells}"
    return (f"GPU-hours: {seconds / 3600:,.1f} estimated ({where}; acting and updates only: env stepping, "
            f"evaluations, checkpoints and the gather step are not counted)")
