"""Command-line flags derived from the run models: one flag per setting, its help and default read from the field
(the single source, so the help never drifts from what a run does; per-agent defaults listed each)."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from qed_ray.spec.cli_help import plain
from qed_ray.spec.config import AGENT_SPECS, RunSpec, TemperatureSpec, TrainSpec
from qed_ray.spec.naming import format_value
from qed_ray.spec.tasks import TASKS

# Flag names that are not simply the setting's name (which is ambiguous or unhelpful on its own).
RENAMES = {("agent", "name"): "agent", ("temperature", "kind"): "temperature", ("temperature", "lr"): "alpha_lr",
           ("train", "debug", "crash_at_env_step"): "debug_crash_at_env_step",
           ("train", "debug", "nan", "env_step"): "debug_nan_at_env_step",
           ("train", "debug", "nan", "seed"): "debug_nan_seed",
           # SAC-LN's HL-Gauss support; MAD-SAC's (agent.mad.vmin, ...) keeps the plain names it had first
           **{("agent", "hl", f): f"hl_{f}" for f in ("vmin", "vmax", "num_bins", "sigma_ratio")}}


@dataclass(frozen=True)
class Flag:
    """One command-line flag: where its value goes in a RunSpec and how it is shown."""

    dest: str  # argparse destination, e.g. ``batch_size`` (flag ``--batch-size``)
    path: tuple[str, ...]  # e.g. ``("agent", "mad", "proportion_real")``
    type: Any  # int, float, str or :func:`parse_bool`
    choices: tuple | None
    help: str
    agents: tuple[str, ...] = ()  # an agent setting: the agents that have it (() for the settings of every run)

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no) for boolean settings."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return value


def _type_of(annotation) -> tuple[Any, tuple | None]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is Literal:
        return str, tuple(typing.get_args(annotation))
    if args and typing.get_origin(annotation) is not Literal:  # X | None
        return _type_of(args[0])
    return {bool: parse_bool, int: int, float: float}.get(annotation, str), None


def _leaves(cls: type[BaseModel], path: tuple[str, ...]):
    for name, info in cls.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaves(ann, (*path, name))
        else:
            yield (*path, name), info


def _default_text(defaults: dict[str, Any]) -> str:
    """``default: 8``, ``default: 256 for sac_ln, 512 for mad_sac`` or ``mad_sac only; default: 0.5``; ``defaults``
    maps the owner (an agent name, or "" for settings every run has) to its default."""
    shown = {owner: "none" if v is None else format_value(v) for owner, v in defaults.items()}
    values = list(dict.fromkeys(shown.values()))
    if "" in shown or (len(shown) == len(AGENT_SPECS) and len(values) == 1):
        return f"default: {values[0]}"
    if len(values) == 1:
        return f"{', '.join(shown)} only; default: {values[0]}"
    return "default: " + ", ".join(f"{v} for {owner}" for owner, v in shown.items())


def run_flags() -> list[Flag]:
    """Every RunSpec setting as a flag (agent settings merged over all registered agents)."""
    found: dict[tuple[str, ...], tuple[Any, dict[str, Any]]] = {
        (name,): (RunSpec.model_fields[name], {"": RunSpec.model_fields[name].default}) for name in ("task", "seed")}
    sources = [("", TemperatureSpec, "temperature"), ("", TrainSpec, "train"),
               *((name, cls, "agent") for name, cls in AGENT_SPECS.items())]
    for owner, cls, root in sources:
        for path, info in _leaves(cls, (root,)):
            found.setdefault(path, (info, {}))[1][owner] = info.default
    # Each agent spec fixes its own name; the choice among them and its default are the run's.
    found[("agent", "name")] = (found[("agent", "name")][0], {"": RunSpec.model_fields["agent"].default.name})
    flags, seen = [], {}
    for path, (info, defaults) in found.items():
        dest = RENAMES.get(path, path[-1])
        if dest in seen:
            raise RuntimeError(f"settings {seen[dest]} and {path} would share the flag --{dest}")
        seen[dest] = path
        kind, choices = _type_of(info.annotation)
        if path == ("agent", "name"):
            choices = tuple(AGENT_SPECS)
        text = info.description or ""
        if path == ("task",):
            text += f", one of: {', '.join(TASKS)} (required)"
        else:
            text += f" ({_default_text(defaults)})"
        owners = tuple(o for o in defaults if o) if path != ("agent", "name") else ()
        flags.append(Flag(dest, path, kind, choices, text.replace("%", "%%"), owners))
    order = {"task": 0, "seed": 1, "agent": 2, "temperature": 3, "train": 4}
    return sorted(flags, key=lambda f: (order[f.path[0]], f.path != ("agent", "name")))


def add_run_flags(parser: argparse.ArgumentParser) -> list[Flag]:
    """Adds :func:`run_flags` to ``parser`` (every default None: only what the user gives is set). The test-only
    ``train.debug`` settings work but stay out of ``--help``."""
    flags = run_flags()
    groups = {s: parser.add_argument_group(f"{s} settings") for s in ("agent", "temperature", "train")}
    for f in flags:
        target = groups.get(f.path[0], parser)
        target.add_argument(f.option, dest=f.dest, type=f.type, choices=f.choices, default=None,
                            help=argparse.SUPPRESS if "debug" in f.path else plain(f.help),
                            metavar=None if f.choices else f.dest.upper())
    return flags


def settings_from_args(args: argparse.Namespace, flags: list[Flag], base: dict | None = None) -> dict:
    """``base`` (e.g. a --config mapping) with every given flag written at its path (flags win); ValueError naming
    each given flag that the run's agent does not have."""
    raw = dict(base or {})
    for f in flags:
        value = getattr(args, f.dest)
        if value is None:
            continue
        node = raw
        for key in f.path[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"{'.'.join(f.path[:-1])}: the --config value is not a mapping")
        node[f.path[-1]] = value
    _check_agent_flags(args, flags, raw)
    return raw


def _check_agent_flags(args: argparse.Namespace, flags: list[Flag], raw: dict) -> None:
    agent = raw.get("agent") if isinstance(raw.get("agent"), dict) else {}
    name = agent.get("name", RunSpec.model_fields["agent"].default.name)
    if not isinstance(name, str) or name not in AGENT_SPECS:
        return  # the run's validation names the unknown agent
    foreign = [f for f in flags if getattr(args, f.dest) is not None and f.agents and name not in f.agents]
    if foreign:
        raise ValueError("\n".join(f"{f.option} applies to {' and '.join(f.agents)}, but the agent is {name} "
                                   f"(give --agent {f.agents[0]}, or drop {f.option})" for f in foreign))
