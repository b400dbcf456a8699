"""Update metrics as one vector: a declared column layout and an on-device interval accumulator.

An agent's ``update`` returns one tensor [K] whose columns are named by the agent's :class:`MetricLayout`. A
column whose name ends in ``_max`` keeps the interval's maximum, ``_min`` its minimum, every other column the
mean. The trainer adds each update's vector with one fused expression on the device (no per-key loop, no host
sync) and reads the interval once, at report time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MEAN, MAX, MIN = 0, 1, 2


@dataclass(frozen=True)
class MetricLayout:
    """Names of the columns of an update's metric vector, in order."""

    names: tuple[str, ...]  # K unique names, e.g. loss/critic, alpha/actor_max

    def __post_init__(self):
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise ValueError(f"MetricLayout.names: duplicated {dup}")

    @property
    def kinds(self) -> tuple[int, ...]:
        """Per column: MEAN, MAX or MIN, from the name's suffix."""
        return tuple(MAX if n.endswith("_max") else MIN if n.endswith("_min") else MEAN for n in self.names)

    def index(self, name: str) -> int:
        """Column of ``name``; raises KeyError listing the layout's names."""
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"metric {name!r} is not one of {', '.join(self.names)}") from None

    def as_dict(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: 0-d tensor}`` views of a metric vector [K] (for tests and ad-hoc reading)."""
        if values.shape[-1] != len(self.names):
            raise ValueError(f"metric vector has {values.shape[-1]} columns, layout has {len(self.names)}")
        return dict(zip(self.names, values.unbind(-1)))


class MetricAccumulator:
    """Interval statistics of metric vectors [K] (``seeds`` None) or [S, K] (a pack's, read with the ``*_per_seed``
    methods) on ``device``: running sums, maxima and minima."""

    def __init__(self, layout: MetricLayout, device: torch.device, dtype: torch.dtype = torch.float32,
                 seeds: int | None = None):
        self.layout = layout
        kinds = torch.tensor(layout.kinds, device=device)
        self._is_max, self._is_min = kinds == MAX, kinds == MIN
        self._empty = torch.where(self._is_max, -math.inf, torch.where(self._is_min, math.inf, 0.0)).to(dtype)
        if seeds is not None:
            self._empty = self._empty.expand(seeds, -1).clone()
        self.total = self._empty.clone()
        self.count = 0

    def add(self, values: torch.Tensor) -> None:
        """Folds one update's vector into the interval, in place (one expression, no host sync)."""
        self.fold(values)
        self.count += 1

    def fold(self, values: torch.Tensor) -> None:
        """The device half of :meth:`add`: folds ``values`` into :attr:`total` in place without counting it (a
        CUDA graph replays this part; its caller counts each replay with :meth:`counted`)."""
        acc = self.total
        acc.copy_(torch.where(self._is_max, torch.maximum(acc, values),
                              torch.where(self._is_min, torch.minimum(acc, values), acc + values)))

    def counted(self, n: int = 1) -> None:
        """The host half of :meth:`add`: ``n`` more updates were folded in."""
        self.count += n

    def non_finite(self, prefixes: tuple[str, ...]) -> list[str]:
        """Names starting with one of ``prefixes`` whose interval value is NaN/inf (one host sync); [] if empty."""
        return self._non_finite(self.total.unsqueeze(0), prefixes)[0]

    def non_finite_per_seed(self, prefixes: tuple[str, ...]) -> list[list[str]]:
        return self._non_finite(self.total, prefixes)

    def _non_finite(self, rows: torch.Tensor, prefixes: tuple[str, ...]) -> list[list[str]]:
        if not self.count:
            return [[] for _ in range(rows.shape[0])]
        cols = [i for i, n in enumerate(self.layout.names) if n.startswith(prefixes)]
        flags = torch.isfinite(rows[:, cols]).cpu().numpy()
        return [[self.layout.names[c] for c, ok in zip(cols, row) if not ok] for row in flags]

    def means(self) -> dict[str, float]:
        """Interval means (maxima, minima for ``_max``/``_min`` columns) as floats, then resets; {} if empty."""
        return self._means(self.total.unsqueeze(0))[0]

    def means_per_seed(self) -> list[dict[str, float]]:
        return self._means(self.total)

    def _means(self, rows: torch.Tensor) -> list[dict[str, float]]:
        if not self.count:
            return [{} for _ in range(rows.shape[0])]
        vals = rows.double().cpu().numpy()  # the one read per interval
        vals = np.where(np.asarray(self.layout.kinds) == MEAN, vals / self.count, vals)
        self.reset()
        return [{k: float(v) for k, v in zip(self.layout.names, row)} for row in vals]

    def reset(self) -> None:
        """Starts a new interval."""
        self.total.copy_(self._empty)
        self.count = 0
