"""The test kit: the tiny settings every agent-level test builds from, and the small process helpers of the
end-to-end tests (free ports, processes seen through /proc). Defined here once; sweep folders by hand are in
``folder_helpers.py``, sweep specs and the real CLI in ``sweep_helpers.py``, fixtures in ``conftest.py``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from qed_ray.config import MadSpec, TemperatureSpec, agent_spec

OBS, ACT, B = 5, 2, 16  # observation and action sizes of the synthetic batches, and their batch size
QED = {"kind": "qed", "k": 0.2, "n_actions": 4, "alpha_max": 0.5, "init_alpha": 0.02}  # QED with N = 4 samples
# "qed" measures QED at s' for the TD target too (target_alpha: qed, the default before App. C's floor became it),
# so the maths tests cover every QED pass and match the format-1 oracle (tests/reference_update.py)
TEMPERATURES = {"te": TemperatureSpec(kind="te"), "fixed": TemperatureSpec(kind="fixed", alpha=0.05),
                "qed": TemperatureSpec(**QED, target_alpha="qed")}
TINY_MAD = {"latent_dim": 16, "encoder_hidden": 16, "model_hidden": 16, "num_bins": 21, "vmin": -10.0,
            "vmax": 10.0}


def tiny_mad(**overrides) -> MadSpec:
    """MAD-SAC's world-model settings at test size (``overrides`` replace single fields)."""
    return MadSpec(**{**TINY_MAD, **overrides})


def spec_of(name: str, mad: dict | None = None, **overrides):
    """A tiny agent spec (16 hidden units, batch :data:`B`); MAD-SAC gets :func:`tiny_mad` with ``mad``'s fields."""
    extra = {"mad": tiny_mad(**(mad or {}))} if name == "mad_sac" else {}
    return agent_spec(name=name, **{"hidden": 16, "batch_size": B, **extra, **overrides})


def batch_of(seed: int, b: int = B, lead: tuple[int, ...] = (), dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A seeded synthetic batch: observations N(0, 1) [*lead, b, OBS], actions U(-1, 1), rewards U(0, 2), no
    terminal transitions."""
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(*lead, b, OBS, generator=g, dtype=dtype),
            "action": torch.rand(*lead, b, ACT, generator=g, dtype=dtype) * 2 - 1,
            "reward": torch.rand(*lead, b, generator=g, dtype=dtype) * 2,
            "next_obs": torch.randn(*lead, b, OBS, generator=g, dtype=dtype),
            "terminated": torch.zeros(*lead, b, dtype=dtype)}


def free_port() -> int:
    """A TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmdline(pid: int) -> str:
    """The process's command line with spaces between its arguments, or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent's pid, ...; the
    start time is index 19), or [] once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def descendants(root: int) -> set[int]:
    """Every process below ``root`` (children, their children, ...), from one read of /proc."""
    parents = {int(e): stat_fields(int(e)) for e in os.listdir("/proc") if e.isdigit()}
    parents = {pid: int(fields[1]) for pid, fields in parents.items() if fields}
    found, grew = {root}, True
    while grew:
        children = {p for p, pp in parents.items() if pp in found} - found
        found |= children
        grew = bool(children)
    return found - {root}


def lone_trial_process(root: int) -> int | None:
    """The pid of the one Tune trial process (``ray::ImplicitFunc``) below ``root`` (a driver with its own Ray, or
    a node's raylet); None while there is none or more than one."""
    found = [pid for pid in descendants(root) if cmdline(pid).startswith("ray::ImplicitFunc")]
    return found[0] if len(found) == 1 else None


# groups.csv's columns in order: the original ten, then the added ones (tables.group_rows).
GROUP_COLUMNS = ["task", "agent", "variant", "n_seeds", "mean_return", "std_return_across_seeds", "V",
                 "action_distance", "q1_dispersion", "early_q_gap", "n_failed", "V_ci_lower", "V_ci_upper",
                 "action_distance_ci_lower", "action_distance_ci_upper", "score_var", "alpha_frac_floor",
                 "alpha_frac_cap", "alpha_frac_floor_late", "alpha_frac_cap_late", "log_std_at_min", "qed_at_cap",
                 "n_unverified", "alpha_frac_hot_late", "alpha_ratio_late", "entropy_late", "entropy_gap_late",
                 "alpha_regime"]


HEAVY = ("torch", "ray", "ray.tune", "mlflow")  # what a CLI call that only reads or refuses must not import
_PROBE = """import atexit, json, os, runpy, sys
atexit.register(lambda: json.dump(sorted(m for m in sys.modules if m in {heavy}),
                                  open(os.environ["QED_TEST_LOADED"], "w")))
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def cli_run(tmp: Path, module: str, *args: str, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``python -m module args`` in a fresh interpreter (``env`` added to this one's environment), and which of
    :data:`HEAVY` it had imported when it exited (``tmp``: a folder for that list)."""
    loaded = Path(tmp) / "loaded.json"
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(heavy=set(HEAVY)), module, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {}), "QED_TEST_LOADED": str(loaded)})
    return proc, json.loads(loaded.read_text()) if loaded.exists() else []


def flat(text: str) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces (what the commands print is wrapped to 100
    columns when stdout is not a terminal)."""
    return " ".join(text.split())


def widest(text: str) -> int:
    """The widest line of ``text`` that could have been wrapped: a line that is one word (a path longer than the
    width, kept whole so that it can be copied) does not count."""
    return max((len(line) for line in text.splitlines() if len(line.split()) > 1), default=0)
