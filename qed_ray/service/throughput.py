"""The measured throughput table (``throughput.json``): seed-decisions per second of packs on one device.

``benchmarks/gpu_bench.py`` writes it (the GPU run copies it to ``qed_ray/data/throughput.json``); the sweep's
dry run and ``benchmarks/grid_hours.py`` read it to turn a grid's seed-decisions into GPU-hours. One entry per
measured cell::

    {"schema": 1, "device": "cuda", "card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26T10:40:00+00:00",
     "torch": "2.11.0+cu128", "hidden": 512, "batch": 512, "obs_dim": 17, "action_dim": 6,
     "entries": [{"agent": "sac_ln", "temperature": "qed", "seeds": 10, "packs": 1, "mode": "graph",
                  "seed_decisions_per_s": 2400.0, "peak_mib": 900.0, ...}, ...],
     "checks": {...}}

``seed_decisions_per_s`` of an entry is one pack's: S x that pack's decisions per second (act + one update,
UTD 1, synthetic observations, no envs) while ``packs`` such packs shared the device. ``mode`` is the update's
(``graph``, ``compile``, ``off``) or ``single`` for the single-seed code path (S = 1). ``precision`` is the
cell's ``train.precision`` (:mod:`qed_ray.rl.precision`); an entry without it (tables written before the option) is
``fp32``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from qed_ray.config import Precision

SCHEMA = 1
MODES = ("graph", "compile", "off", "single")
DEFAULT_PATH = Path(__file__).parents[1] / "data" / "throughput.json"
SHARE_CELL = ("sac_ln", "qed", 10)  # the cell gpu_bench.py measures with 2 and 3 packs sharing the GPU
ENTRY_FIELDS = ("agent", "temperature", "seeds", "packs", "mode", "seed_decisions_per_s")
PRECISIONS = get_args(Precision)[1:]  # a measured cell's precision: never "auto"


@dataclass(frozen=True)
class Throughput:
    """A measured table: the device it was measured on and its entries (see the module docstring)."""

    device: str
    card: str
    date: str
    entries: tuple[dict, ...]

    def entry(self, agent: str, temperature_kind: str, seeds_per_pack: int, packs_per_gpu: int = 1,
              mode: str = "graph", precision: str = "fp32") -> dict | None:
        """The entry of that cell, or None if it was not measured."""
        for e in self.entries:
            if (e["agent"], e["temperature"], e["seeds"], e["packs"], e["mode"], e.get("precision", "fp32")) == \
                    (agent, temperature_kind, seeds_per_pack, packs_per_gpu, mode, precision):
                return e
        return None

    def decisions_per_s(self, agent: str, temperature_kind: str, seeds_per_pack: int, packs_per_gpu: int = 1,
                        mode: str = "graph", precision: str = "fp32") -> float | None:
        """Seed-decisions per second of one **GPU** holding ``packs_per_gpu`` packs of ``seeds_per_pack`` seeds of
        (agent, temperature kind) whose update runs in ``mode``: the measured per-pack rate times the packs; None
        if that cell was not measured (no interpolation: an estimate says which cell it lacks).

        Raises:
            ValueError: a mode that is not one of :data:`MODES`.
        """
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
        e = self.entry(agent, temperature_kind, seeds_per_pack, packs_per_gpu, mode, precision)
        return None if e is None else float(e["seed_decisions_per_s"]) * packs_per_gpu

    def shared_rate(self, agent: str, temperature_kind: str, seeds_per_pack: int, packs_per_gpu: int = 1,
                    mode: str = "graph", precision: str = "fp32") -> tuple[float, bool] | None:
        """(seed-decisions/s of one GPU, scaled): :meth:`decisions_per_s` where that cell was measured; else, for
        ``packs_per_gpu`` > 1, the one-pack rate times the sharing efficiency measured for the reference cell
        :data:`SHARE_CELL` (``scaled`` True; at the same precision where measured, else at fp32); None when
        neither was measured."""
        rate = self.decisions_per_s(agent, temperature_kind, seeds_per_pack, packs_per_gpu, mode, precision)
        if rate is not None or packs_per_gpu == 1:
            return None if rate is None else (rate, False)
        alone = self.decisions_per_s(agent, temperature_kind, seeds_per_pack, 1, mode, precision)
        a, k, s = SHARE_CELL
        ref = precision if self.entry(a, k, s, packs_per_gpu, mode, precision) else "fp32"
        ref_shared, ref_alone = (self.decisions_per_s(a, k, s, packs_per_gpu, mode, ref),
                                 self.decisions_per_s(a, k, s, 1, mode, ref))
        if alone is None or ref_shared is None or ref_alone is None:
            return None
        return alone * ref_shared / ref_alone, True


def parse_throughput(raw: dict) -> Throughput:
    """Validates a table read from JSON.

    Raises:
        ValueError: a wrong schema version, a missing field (named), a mode outside :data:`MODES` or a precision
            outside :data:`PRECISIONS`.
    """
    if raw.get("schema") != SCHEMA:
        raise ValueError(f"throughput: schema {raw.get('schema')!r}, this reader reads schema {SCHEMA}")
    for key in ("device", "card", "date", "entries"):
        if key not in raw:
            raise ValueError(f"throughput: field {key!r} is missing")
    for i, e in enumerate(raw["entries"]):
        missing = [k for k in ENTRY_FIELDS if k not in e]
        if missing:
            raise ValueError(f"throughput: entries[{i}] lacks {', '.join(missing)}")
        if e["mode"] not in MODES:
            raise ValueError(f"throughput: entries[{i}].mode {e['mode']!r} is not one of {', '.join(MODES)}")
        if e.get("precision", "fp32") not in PRECISIONS:
            raise ValueError(f"throughput: entries[{i}].precision {e['precision']!r} is not one of "
                             f"{', '.join(PRECISIONS)}")
    return Throughput(str(raw["device"]), str(raw["card"]), str(raw["date"]), tuple(raw["entries"]))


def load_throughput(path: str | Path = DEFAULT_PATH) -> Throughput | None:
    """The GPU table at ``path``; None when the file is missing or holds no GPU measurement (a CPU table or the
    committed placeholder): callers then say "no GPU measurement yet".

    Raises:
        ValueError: a malformed table (see :func:`parse_throughput`).
    """
    path = Path(path)
    if not path.is_file():
        return None
    table = parse_throughput(json.loads(path.read_text()))
    return table if table.device.startswith("cuda") and table.entries else None
