"""How a setting's value is written in a name and read back, and the temperature's label: the bottom of the
vocabulary, below the config models (which name their temperature with it) and :mod:`qed_ray.spec.naming`."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from pydantic import BaseModel

SEP = "+"  # between the parts of a variant label
PRIMARY = {"fixed": "alpha", "qed": "k"}  # the value written right after the kind
_FORBIDDEN = ("/", "__", SEP, "=")  # would break folder names or the parse
KIND_RE = re.compile(r"(te|fixed|qed)(.*)")  # a variant label's temperature kind and the rest
_INT_RE = re.compile(r"-?\d+")


def format_value(value: Any) -> str:
    """Shortest text that reads back as ``value``: ``0.2``, ``1e-05``, ``1e6``, ``512``, ``true``, ``relu``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        short = format(value, "g")
        # "+" separates a label's settings, so a large value's exponent is written without it (1e+06 -> 1e6)
        return re.sub(r"e\+0*", "e", short if float(short) == value else repr(value))
    text = str(value)
    if any(bad in text for bad in _FORBIDDEN):
        raise ValueError(f"{text!r} cannot appear in a trial name (it contains one of {' '.join(_FORBIDDEN)})")
    return text


def parse_value(text: str) -> Any:
    """Inverse of :func:`format_value` (the model's validation fixes int/float where both read alike)."""
    if text in ("true", "false"):
        return text == "true"
    if _INT_RE.fullmatch(text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def differences(model: BaseModel) -> dict[str, Any]:
    """``{dotted.path: value}`` of every leaf setting of ``model`` whose value differs from its default."""
    out: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out.update({f"{name}.{k}": v for k, v in differences(value).items()})
        elif value != info.default:
            out[name] = value
    return out


def temperature_label(t: BaseModel) -> str:
    """``te``, ``fixed0.05``, ``qed0.2``, then ``+field=value`` for each other non-default temperature setting."""
    primary = PRIMARY.get(t.kind)
    label = t.kind + (format_value(getattr(t, primary)) if primary else "")
    extras = {k: v for k, v in differences(t).items() if k not in ("kind", primary)}
    return label + "".join(f"{SEP}{k}={format_value(v)}" for k, v in extras.items())


def settings_label(final_eval: Mapping[str, Any], sweep_params: Mapping[str, str], fields: Sequence[str]) -> str:
    """What a re-analysis changed: ``episodes=8 bootstrap_reps=300`` for each of ``fields`` whose value in
    ``final_eval`` (JSON form) differs from the sweep's own (``final_eval.*`` params as MLflow keeps them: ``str`` of
    the JSON form), or ``sweep settings`` (no quote: the label is matched in a filter)."""
    def shown(v):
        return ",".join(map(str, v)) if isinstance(v, list) else format_value(v)
    changed = [f"{k}={shown(final_eval[k])}" for k in fields
               if str(final_eval[k]) != sweep_params.get(f"final_eval.{k}")]
    return " ".join(changed) or "sweep settings"
