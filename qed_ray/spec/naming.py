"""Run identity and names: the one label/parse pair of a variant, and the identity of a run (docs/design.md, "What
names what"). Settings a whole sweep shares belong to the sweep's identity, not to every trial's name."""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable

from pydantic import BaseModel

from qed_ray.spec.config import AGENT_SPECS, RunSpec, TemperatureSpec, TrainSpec
from qed_ray.spec.labels import (KIND_RE, PRIMARY, SEP, differences, format_value,  # noqa: F401 - API
                                 parse_value, temperature_label)

# Settings a run's identity records even at their default, because their default changed: an identity written
# before the change (without them) meant the old default (temperature.target_alpha: qed until sweep.json format 3).
EXPLICIT = {"qed": ("target_alpha",)}


def identity(run: RunSpec) -> dict[str, Any]:
    """What a run *is*: task, agent, seed, temperature kind, every non-default setting and the settings of
    :data:`EXPLICIT`, as a flat dict."""
    out = {"task": run.task, "agent": run.agent.name, "seed": run.seed, "temperature.kind": run.temperature.kind}
    for section in ("agent", "temperature", "train"):
        out.update({f"{section}.{k}": v for k, v in differences(getattr(run, section)).items()
                    if k not in ("name", "kind")})
    out.update({f"temperature.{k}": getattr(run.temperature, k) for k in EXPLICIT.get(run.temperature.kind, ())})
    return dict(sorted(out.items()))


def variant_label(run: RunSpec, axes: Iterable[str] = ()) -> str:
    """The run's variant: its temperature label, then ``+field=value`` for each grid axis (``agent.hidden``) whose
    value differs from its default, in sorted order."""
    label = temperature_label(run.temperature)
    diffs = {f"{s}.{k}": v for s in ("agent", "train") for k, v in differences(getattr(run, s)).items()}
    for path in sorted(set(axes)):
        if path in diffs:
            label += f"{SEP}{path.split('.', 1)[1]}={format_value(diffs[path])}"
    return label


@functools.cache
def _sections() -> dict[str, str]:
    """Leaf setting path (as written in a label) -> section (``agent``/``temperature``/``train``)."""
    out: dict[str, str] = {}
    models = [("temperature", TemperatureSpec), ("train", TrainSpec), *(("agent", c) for c in AGENT_SPECS.values())]
    for section, cls in models:
        for path in _leaf_paths(cls):
            if out.setdefault(path, section) != section:
                raise RuntimeError(f"setting {path!r} exists in both {out[path]} and {section}: labels would be "
                                   f"ambiguous")
    return out


def _leaf_paths(cls: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in cls.model_fields.items():
        sub = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel) \
            else None
        out.extend(_leaf_paths(sub, f"{prefix}{name}.") if sub else [f"{prefix}{name}"])
    return out


def parse_variant(label: str) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`variant_label`: ``{"temperature": {...}, "agent": {...}, "train": {...}}``, nested mappings
    of the settings the label names."""
    head, *parts = label.split(SEP)
    m = KIND_RE.fullmatch(head)
    if m is None or (m.group(1) in PRIMARY) != bool(m.group(2)):
        raise ValueError(f"variant {label!r}: does not start with te, fixed<alpha> or qed<k>")
    kind, value = m.groups()
    out: dict[str, dict[str, Any]] = {"temperature": {"kind": kind}, "agent": {}, "train": {}}
    if kind in PRIMARY:
        out["temperature"][PRIMARY[kind]] = parse_value(value)
    for part in parts:
        path, eq, text = part.partition("=")
        section = _sections().get(path)
        if not eq or section is None:
            raise ValueError(f"variant {label!r}: {part!r} is not a known setting=value")
        node = out[section]
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = parse_value(text)
    return out


def split_variant(label: str) -> tuple[str, str]:
    """``(temperature kind, the label of its te baseline)``: ``("qed", "te+hidden=512")`` for
    ``qed0.2+alpha_max=0.3+hidden=512``, ``("te", "te")`` for ``te``; ``("", "")`` for a label this module did not
    write."""
    try:
        kind = parse_variant(label)["temperature"]["kind"]
    except ValueError:
        return "", ""
    rest = [p for p in label.split(SEP)[1:] if _sections()[p.partition("=")[0]] != "temperature"]
    return kind, SEP.join(["te", *rest])

# How a run executes, not what it learns: a resume may change these freely.
EXECUTION_SETTINGS = frozenset({"train.device", "train.threads"})
DEFAULT = "<default>"  # shown for a setting an identity leaves out (it is at its default)


def identity_changes(old: dict[str, Any], new: dict[str, Any],
                     ignore: frozenset[str] = EXECUTION_SETTINGS) -> dict[str, tuple[Any, Any]]:
    """``{setting: (old value, new value)}`` of two identities, sorted, without the ``ignore``d ones; a side that
    leaves a setting out has it at its default and shows :data:`DEFAULT`."""
    keys = sorted((set(old) | set(new)) - ignore)
    return {k: (old.get(k, DEFAULT), new.get(k, DEFAULT)) for k in keys
            if old.get(k, DEFAULT) != new.get(k, DEFAULT)}


def show_setting(value: Any) -> str:
    """A setting's value as JSON (``0.1``, ``"te"``), or :data:`DEFAULT` as it is."""
    return value if value == DEFAULT else json.dumps(value)
