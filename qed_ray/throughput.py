"""The measured throughput table ``qed_ray/data/throughput.json``: seed-decisions per second on one GPU.

A minimal reader (the GPU benchmark writes the table; the sweep's ``--dry-run`` turns a grid into GPU-hours with
it). Layout::

    {"schema": 1, "device": "cuda", "card": "NVIDIA H100 80GB HBM3", "date": "2026-11-26",
     "entries": [{"agent": "sac_ln", "temperature": "qed", "seeds": 10, "packs": 2, "mode": "graph",
                  "seed_decisions_per_s": 2400.0}, ...]}

An entry's ``seed_decisions_per_s`` is one pack's: S x that pack's decisions per second while ``packs`` such packs
shared the GPU. ``mode`` is how the update ran (``graph``, ``compile``, ``off``), or ``single`` for the
single-seed code path (S = 1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SCHEMA = 1
MODES = ("graph", "compile", "off", "single")
DEFAULT_PATH = Path(__file__).parent / "data" / "throughput.json"
ENTRY_FIELDS = ("agent", "temperature", "seeds", "packs", "mode", "seed_decisions_per_s")


@dataclass(frozen=True)
class Throughput:
    """A measured table: the card, when it was measured, and its entries."""

    device: str
    card: str
    date: str
    entries: tuple[dict, ...]

    def decisions_per_s(self, agent: str, temperature_kind: str, seeds_per_pack: int, packs_per_gpu: int = 1,
                        mode: str = "graph") -> float | None:
        """Seed-decisions per second of one GPU holding ``packs_per_gpu`` packs of ``seeds_per_pack`` seeds of
        (agent, temperature kind), the update in ``mode``: the measured per-pack rate times the packs; None if that
        cell was not measured (no interpolation).

        Raises:
            ValueError: a mode that is not one of :data:`MODES`.
        """
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)}")
        for e in self.entries:
            if (e["agent"], e["temperature"], e["seeds"], e["packs"], e["mode"]) == \
                    (agent, temperature_kind, seeds_per_pack, packs_per_gpu, mode):
                return float(e["seed_decisions_per_s"]) * packs_per_gpu
        return None


def load_throughput(path: str | Path = DEFAULT_PATH) -> Throughput | None:
    """The GPU table at ``path``; None when the file is missing or holds no GPU measurement.

    Raises:
        ValueError: another schema, or a field missing (named).
    """
    path = Path(path)
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if raw.get("schema") != SCHEMA:
        raise ValueError(f"throughput: {path}: schema {raw.get('schema')!r}, this reader reads schema {SCHEMA}")
    missing = [k for k in ("device", "card", "date", "entries") if k not in raw]
    missing += [f"entries[{i}].{k}" for i, e in enumerate(raw.get("entries", [])) for k in ENTRY_FIELDS if k not in e]
    if missing:
        raise ValueError(f"throughput: {path}: missing {', '.join(missing)}")
    table = Throughput(str(raw["device"]), str(raw["card"]), str(raw["date"]), tuple(raw["entries"]))
    return table if table.device.startswith("cuda") and table.entries else None
