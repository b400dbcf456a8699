"""``sweep.json``: a sweep's record of itself (:class:`SweepState`) and its one reader and writer.

Every start writes it (atomically, :func:`qed_ray.service.sweep_state.plan` decides what it holds); a driver start,
``--status``, ``--dry-run``, the re-analysis, relink and behaviour commands read it. A file that is missing a field,
holds a wrong type, is truncated, is not JSON, is a folder or a dangling symbolic link, or names trials and packs
that cannot be this sweep's is refused naming the file and the field, with the way out: restore it, or move the
folder aside with ``--fresh --force`` (its name cannot be checked, so ``--fresh`` alone does not).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator

from qed_ray.codec import Num, Record, RecordError, read_record, write_record
from qed_ray.layout import PackId, SweepDir, TrialId
from qed_ray.spec import SpecError

STATE_FORMAT = 3  # 3: QED trials record temperature.target_alpha, whose default became floor
# The sweep id goes into MLflow search filters and run tags: letters, digits and -_. only (uuid hex today).
SWEEP_ID = r"^[0-9A-Za-z][0-9A-Za-z_.-]{0,63}$"


class StateDamaged(SpecError, RecordError):
    """``sweep.json`` cannot be read (:attr:`problem` names the file and what is wrong); the message adds the way
    out."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}; restore it, or start over with --fresh --force (the folder is moved aside, "
                         f"nothing is deleted)")
        self.problem = problem


class ClaimRecord(Record):
    """The pre-registration frozen at the sweep's first start (:mod:`qed_ray.claim`): the file, the SHA-256 of its
    claim block and the block."""

    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    block: dict[str, Any]


class SweepState(Record):
    """``sweep.json``: the sweep's stable id and name, the identity of every trial it holds
    (:func:`qed_ray.naming.identity`), its pack size, packing (``pack_by``, written only when it is not the default
    ``variant``, so older sweeps' files read and write as before) and packs (:mod:`qed_ray.service.packing`), its
    claim record and the spec of its latest start as JSON (``--status --dir`` reads the sweep by it; None in a file
    an older release wrote). A file of format 1 (before per-trial identities) has no ``trials``, only the grid's
    ``fingerprint``."""

    sweep_id: str = Field(pattern=SWEEP_ID)
    created: Num = Field(ge=0)
    format: int = Field(1, ge=1, le=STATE_FORMAT)
    name: str | None = Field(None, min_length=1)
    fingerprint: str | None = None
    trials: dict[str, dict[str, Any]] | None = None
    pack_seeds: int = Field(1, ge=1)
    pack_by: Literal["variant", "shape"] = "variant"
    packs: dict[str, list[str]] = Field(default_factory=dict)
    claim: ClaimRecord | None = None
    spec: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _names_are_trials_and_packs(self) -> "SweepState":
        for name in self.trials or {}:
            try:
                TrialId.from_name(name)
            except ValueError as e:
                raise ValueError(f"trials: {e}") from None
        for name, members in self.packs.items():
            try:
                pack = PackId.of(members)
            except ValueError as e:
                raise ValueError(f"packs.{name}: {e}") from None
            if pack.name != name:
                raise ValueError(f"packs.{name}: its trials {members} form the pack {pack.name!r}")
        return self

    @model_serializer(mode="wrap")
    def _pack_by_only_when_not_the_default(self, handler) -> dict[str, Any]:
        data = handler(self)
        if self.pack_by == "variant":
            data.pop("pack_by", None)
        return data


def read_state(layout: SweepDir) -> SweepState | None:
    """``sweep.json`` (None if there is none); a damaged or foreign one raises :class:`StateDamaged` naming the
    file and the field, with the way out."""
    if not os.path.lexists(layout.state_file):
        return None
    try:
        return read_record(layout.state_file, SweepState)
    except RecordError as e:
        raise StateDamaged(str(e)) from None


def sweep_id(layout: SweepDir) -> str:
    """The sweep id its ``sweep.json`` records; raises SpecError when the folder has none (or a damaged one)."""
    state = read_state(layout)
    if state is None:
        raise SpecError(f"sweep_dir: {layout.root} is not a sweep folder (no {layout.state_file.name})")
    return state.sweep_id


def write_state(layout: SweepDir, state: SweepState) -> None:
    """Writes ``sweep.json`` atomically."""
    write_record(layout.state_file, state)
