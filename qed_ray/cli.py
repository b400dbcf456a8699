"""``qed-ray COMMAND ...``: qed_ray's one command line (also ``python -m qed_ray COMMAND ...``).

Each command hands its arguments to its wing's own parser (``qed-ray sweep --help``); a command's module is imported
only when it is named, so ``qed-ray --help`` and every command's ``--help`` answer at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module whose main(argv) runs it, what it does)
COMMANDS = {
    "sweep": ("qed_ray.service.sweep_cli", "run a sweep spec (here or as a Ray job); --dry-run, --status"),
    "run": ("qed_ray.rl.run", "train one run of one or more seeds into a folder, no Ray"),
    "gather": ("qed_ray.service.reanalysis", "re-analyse a sweep folder with other final-evaluation settings"),
    "visualize": ("qed_ray.service.behaviour_cli", "the behaviour figure of a finished sweep (paper Fig. 1)"),
    "analysis": ("qed_ray.analysis.group_eval", "the critic-proxy table of a gathered sweep (paper App. D)"),
    "relink": ("qed_ray.service.mlflow.relink", "relink a moved or copied local sweep folder to its MLflow artifacts"),
    "envs": ("qed_ray.rl.envs", "list and check the tasks"),
    "toy": ("qed_ray.paper.toy", "the toy MDP experiment (paper Sec. 5.2, Fig. 2)"),
    "theory": ("qed_ray.paper.theory", "numerical checks of the paper's theorems (Sec. 4)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: qed-ray COMMAND [ARGS ...]\n\nQED temperatures for SAC as a service: sweeps on Ray Tune, results "
            "in MLflow.\n\ncommands:\n" + "\n".join(lines) + "\n\nqed-ray COMMAND --help shows a command's flags and "
            "examples.")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the named command with the rest of ``argv``; its exit code (2: no or an unknown command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: {name!r} is not a qed-ray command; the commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    code = importlib.import_module(COMMANDS[name][0]).main(rest)
    return code if isinstance(code, int) else 0  # toy and theory return their results
