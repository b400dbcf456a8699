"""Grid axes of a sweep spec: the list-valued settings of a mapping, their product, and its validation, bounded
before anything is expanded (the caller's cap on combinations, :data:`MAX_GRID_VALUES` on the values validated)."""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable

from pydantic import ValidationError

from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.hints import short_text

# Values validated over all combinations of one grid mapping (combinations x values in one). An agent's settings
# are ~40 values, so this admits the 100,000 combinations of qed_ray.spec.sweep.MAX_TRIALS for any real mapping, and
# refuses a mapping padded with junk before it is validated once per combination.
MAX_GRID_VALUES = 5_000_000
MAX_PROBLEMS = 20  # distinct problems listed per grid mapping; past that, fixing those comes first


def _axis_paths(raw: dict, prefix: tuple = ()) -> dict[tuple, list]:
    out: dict[tuple, list] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(_axis_paths(value, (*prefix, key)))
        elif isinstance(value, list):
            out[(*prefix, key)] = value
    return out


def grid_axes(raw: dict) -> dict[str, list]:
    """``{dotted.path: values}`` of the list-valued leaves of a (nested) mapping: the grid axes it declares."""
    return {".".join(short_text(str(k)) for k in path): values for path, values in _axis_paths(raw).items()}


def grid_size(raw: dict) -> int:
    """Without expanding."""
    return math.prod(len(v) for v in _axis_paths(raw).values())


def expand_grid(raw: dict) -> list[dict]:
    """The product of the mapping's axes: one concrete nested mapping per combination, in axis order. A combination
    copies only the mappings on the paths to its axes and shares the rest with ``raw`` (nothing downstream mutates
    them)."""
    axes = _axis_paths(raw)
    out = []
    for combo in itertools.product(*axes.values()):
        concrete = dict(raw)
        copied = {id(concrete)}
        for path, value in zip(axes, combo):
            node = concrete
            for key in path[:-1]:
                if id(node[key]) not in copied:
                    node[key] = dict(node[key])
                    copied.add(id(node[key]))
                node = node[key]
            node[path[-1]] = value
        out.append(concrete)
    return out


def _values_per_combination(value: Any, axis: bool = False) -> int:
    """Values one combination of a grid mapping holds: an axis (a list directly under a mapping) counts its
    largest value, any other list all of its values."""
    if isinstance(value, dict):
        return 1 + sum(1 + _values_per_combination(v, axis=True) for v in value.values())
    if isinstance(value, list):
        sizes = [_values_per_combination(v) for v in value]
        return (max(sizes, default=0) if axis else 1 + sum(sizes))
    return 1


def validate_grid(raw: dict, model: Callable[[dict], Any], what: str, max_combinations: int) -> list:
    """Validates every combination of ``raw``'s axes with ``model``; raises one ValueError listing the problems
    (at most :data:`MAX_PROBLEMS` distinct ones, each bounded in length)."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a mapping of {what} settings")
    axes = grid_axes(raw)
    empty = [path for path, values in _axis_paths(raw).items() if not values]
    if empty:
        raise ValueError(f"{'.'.join(short_text(str(k)) for k in empty[0])}: an empty list gives no trials")
    size = grid_size(raw)
    if size > max_combinations:
        raise ValueError(f"{short_text(' x '.join(axes), 200)}: {size:,} combinations (at most "
                         f"{max_combinations:,})")
    per = _values_per_combination(raw)
    if size * per > MAX_GRID_VALUES:
        raise ValueError(f"{size:,} combinations of {per:,} values each: more than the {MAX_GRID_VALUES:,} values "
                         f"a grid of {what} settings may hold (is something other than settings in it?)")
    specs, problems = [], {}
    for concrete in expand_grid(raw):
        try:
            specs.append(model(concrete))
            continue
        except ValidationError as e:
            lines = format_validation_error(e).splitlines()
        except ValueError as e:  # a check beyond the model's own (a budget that trains nothing)
            lines = [str(e)]
        problems.update(dict.fromkeys(lines))
        if len(problems) >= MAX_PROBLEMS:
            problems["more problems may follow in other combinations (fix these first)"] = None
            break
    if problems:
        raise ValueError("\n".join(problems))
    return specs
