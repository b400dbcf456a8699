"""The measured rate tables: seed-decisions per second of packs on one device, and the machine they came from."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError

from qed_ray.records.codec import Record, load_json
from qed_ray.spec.config import Precision

SCHEMA = 1
MODES = ("graph", "compile", "off")
DATA = Path(__file__).parents[1] / "data"
DEFAULT_PATH, CPU_PATH = DATA / "throughput.json", DATA / "throughput_cpu.json"


class Cell(Record):
    """One measured cell (the module notes); the benchmark's other records (``peak_mib``, ...) pass through."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=False)
    agent: str
    temperature: Literal["te", "qed"]
    seeds: int = Field(ge=1)
    packs: int = Field(ge=1)
    mode: Literal["graph", "compile", "off"]
    seed_decisions_per_s: float = Field(gt=0)
    precision: Precision = "fp32"
    hidden: int | None = None
    batch: int | None = None


class Throughput(Record):
    """A table: the device and machine it was measured on (``card``: the GPU's or CPU's name; ``cpus`` and
    ``host_bytes`` for a CPU table) and its cells; the benchmark's other records pass through."""

    model_config = ConfigDict(frozen=True, extra="allow", strict=False)
    schema_: Literal[1] = Field(alias="schema")
    device: str
    card: str
    date: str
    entries: tuple[Cell, ...]
    hidden: int = 512
    batch: int = 512
    cpus: int | None = None

    def rate(self, agent: str, kind: str, seeds: int, packs: int = 1, mode: str = "graph", precision: str = "fp32",
             shape: tuple[int, int] | None = None) -> float | None:
        """Seed-decisions per second of the device holding ``packs`` packs of ``seeds`` at ``shape`` (hidden,
        batch; None: the table's); None when that cell was not measured."""
        want = (agent, kind, seeds, packs, mode, precision, shape or (self.hidden, self.batch))
        for e in self.entries:
            if (e.agent, e.temperature, e.seeds, e.packs, e.mode, e.precision,
                    (e.hidden or self.hidden, e.batch or self.batch)) == want:
                return e.seed_decisions_per_s * packs
        return None

    def sizes(self, agent: str, kind: str, mode: str, precision: str = "fp32") -> list[int]:
        """The measured sizes of one pack alone at the table's shape, ascending."""
        return sorted({e.seeds for e in self.entries if (e.agent, e.temperature, e.packs, e.mode, e.precision) ==
                       (agent, kind, 1, mode, precision) and e.hidden in (None, self.hidden)})


def parse_throughput(raw: dict) -> Throughput:
    """A table read from JSON; raises ValueError naming the field that is wrong."""
    try:
        return Throughput.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ValueError(f"throughput: {'.'.join(map(str, err['loc']))}: {err['msg']} (got {err.get('input')!r:.60})") \
            from None


def load_table(path: str | Path) -> Throughput | None:
    """The table at ``path`` (None: missing, or no cells); raises ValueError naming the file and the field."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        table = parse_throughput(load_json(path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return table if table.entries else None


def load_throughput(path: str | Path = DEFAULT_PATH) -> Throughput | None:
    """The GPU table at ``path``; None when it is missing or no GPU measurement."""
    table = load_table(path)
    return table if table is not None and table.device.startswith("cuda") else None
