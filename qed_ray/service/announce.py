"""What the sweep tells its user about where it runs and where it stands: the local ``ray job submit`` recipe, the
driver's first lines, the start line of a restarted sweep and where ``--status`` looked. The folder comes from the
*driver's* environment (under ``ray job submit``, the job's): another shell finds it by ``--dir``, which the driver
prints first."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from qed_ray.records.layout import SweepDir
from qed_ray.service.packing import Pack
from qed_ray.service.sweep_state import STORAGE_PATH_ENV, STORAGE_ROOT_ENV
from qed_ray.spec.sweep import SweepSpec

# The local recipe, as the README gives it (tests/service/test_job_submit.py runs the README's copy): the head must run
# the venv's `python`, Ray's token auth must be on for the head and its clients, Ray's temp folder must lie in a private
# one (Ray makes its temp folder, default /tmp/ray, mode 777 and reuses a job package already unpacked there: another
# local account could swap a submitted package for its own code; a 0700 folder above it keeps them out), and only
# --runtime-env-json brings the storage root into the job (a variable exported in the submitting shell stays there).
LOCAL_HEAD = """\
source .venv/bin/activate                    # the head then runs the job's python from the venv
export RAY_AUTH_MODE=token                   # token auth for the head and for its clients
(umask 077 && ray get-auth-token --generate > /dev/null)   # a private ~/.ray/auth_token, if there is none
RAY_PORT=6379 DASHBOARD_PORT=8265 AGENT_PORT=52365   # Ray's default ports: pick free ones where these are taken
export RAY_TMPDIR="$(mktemp -d /tmp/ray-XXXXXXXX)/ray"      # Ray's temp folder, in a folder of yours alone (0700)
ray start --head --temp-dir="$RAY_TMPDIR" --port=$RAY_PORT --dashboard-port=$DASHBOARD_PORT --dashboard-agent-listen-port=$AGENT_PORT
ray job submit --address http://127.0.0.1:$DASHBOARD_PORT --working-dir . \\
    --runtime-env-json '{"env_vars": {"QED_STORAGE_ROOT": "'"$PWD"'"}}' -- python -m qed_ray.sweep sweeps/smoke.yaml"""
LOCAL_STATUS = 'python -m qed_ray.sweep sweeps/smoke.yaml --status --dir "$PWD/results/smoke"'


def local_head_help() -> str:
    """The recipe for ``--help``: the commands, then where results land and how another shell follows them."""
    return (f"on a local Ray head (ray job submit), from the repository root:\n{_indent(LOCAL_HEAD)}\n"
            f"results land in $PWD/results/<name>; from another shell in the repository root:\n"
            f"{_indent(LOCAL_STATUS)}\nand: ray stop  # ends the head, and every other Ray process of yours on this "
            f"machine (Ray has no stop for one head);\n"
            f"     rm -rf \"$(dirname \"$RAY_TMPDIR\")\"  # then its private temp folder")


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def shown(path: Path) -> str:
    """``path`` as a user types it: relative to the current folder (under ``ray job submit``, the uploaded
    ``--working-dir``) when inside it, else absolute."""
    path = Path(path).absolute()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def status_command(spec_path: Path, layout: SweepDir) -> str:
    """``/abs/.venv/bin/python -m qed_ray.sweep SPEC --status --dir FOLDER``: runs from any shell as it is."""
    return (f"{shlex.quote(sys.executable)} -m qed_ray.sweep {shlex.quote(shown(spec_path))} --status "
            f"--dir {shlex.quote(str(layout.root))}")


def first_lines(name: str, spec_path: Path, layout: SweepDir, uri: str) -> list[str]:
    return [f"sweep {name}: results in {layout.root} (MLflow: {uri})",
            f"  progress from any shell: {status_command(spec_path, layout)}"]


def checkpoint_steps(layout: SweepDir, pack: Pack) -> int:
    """Env steps of the pack's newest complete checkpoint (0: none), where each of its seed runs is."""
    return max(layout.pack_checkpoint_steps(pack.id), default=0)


def resumed_env_steps(layout: SweepDir, packs: list[Pack]) -> dict[str, int]:
    """``{pack name: env steps of all its seed runs together}`` (a trial's ``seed_env_steps``) at the checkpoints
    the packs with a pending seed run resume from."""
    out = {}
    for p in packs:
        steps = checkpoint_steps(layout, p)
        if steps and any(layout.trial_state(n) == "pending" for n in p.names):
            out[p.name] = steps * len(p.trials)
    return out


def start_line(spec: SweepSpec, layout: SweepDir, packs: list[Pack], new: list[str]) -> str:
    """``sweep smoke: 12 trials (2 done, 4 resumed from env step 2,000, 6 new) in 12 packs of up to 1 seed``."""
    done, resumed, fresh, diverged = 0, [], 0, 0
    for p in packs:
        steps = checkpoint_steps(layout, p)
        for n in p.names:
            state = layout.trial_state(n)
            done += state == "done"
            diverged += state == "diverged"
            if state == "pending" and steps:
                resumed.append(steps)
            elif state == "pending" and n not in new:
                fresh += 1
    parts = [f"{done} done"] + ([f"{len(resumed)} resumed from {_steps(resumed)}"] if resumed else []) + \
        [f"{len(new)} new"] + ([f"{fresh} starting from scratch"] if fresh else []) + \
        ([f"{diverged} diverged (final)"] if diverged else [])
    seeds = spec.pack.seeds
    return (f"sweep {spec.name}: {len(spec.trials())} trials ({', '.join(parts)}) in {len(packs)} "
            f"pack{'s' if len(packs) != 1 else ''} of up to {seeds} seed{'s' if seeds > 1 else ''}")


def _steps(steps: list[int]) -> str:
    low, high = min(steps), max(steps)
    return f"env step {low:,}" if low == high else f"env steps {low:,} to {high:,}"


def storage_source(spec: SweepSpec) -> str:
    path_env, root_env = os.environ.get(STORAGE_PATH_ENV), os.environ.get(STORAGE_ROOT_ENV)
    raw = path_env or spec.storage_path
    text = f"{STORAGE_PATH_ENV}={path_env}" if path_env else f"storage_path {raw!r} of the spec ({STORAGE_PATH_ENV} " \
                                                             f"not set)"
    if not Path(raw).expanduser().is_absolute():
        text += (f" against {STORAGE_ROOT_ENV}={root_env}" if root_env else
                 f" against the current folder {Path.cwd()} ({STORAGE_ROOT_ENV} not set)")
    return text
