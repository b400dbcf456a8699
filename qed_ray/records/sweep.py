"""``sweep.json``: a sweep's record of itself (:class:`SweepState`) and its one reader and writer."""

from __future__ import annotations

import hmac
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator

from qed_ray.spec import claim as claim_file
from qed_ray.records.codec import Num, Record, RecordError, read_record, write_record
from qed_ray.records.layout import PackId, SweepDir, TrialId, parse_trial_dirname
from qed_ray.records.digests import sign
from qed_ray.spec.sweep import SpecError

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
    """The pre-registration frozen at the sweep's first start (:mod:`qed_ray.spec.claim`): the file, the SHA-256 of its
    claim block, the block, and the HMAC of the sweep id, the file and the SHA-256 under the user's results key
    (written by every driver start; None in a record an older release wrote, until the next start signs it)."""

    file: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    block: dict[str, Any]
    signature: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")


class SweepState(Record):
    """``sweep.json``: the sweep's stable id and name, the identity of every trial it holds
    (:func:`qed_ray.spec.naming.identity`), its pack size, packing (``pack_by``, written only when it is not the default
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


def older_release(layout: SweepDir | None, fmt: int, recorded: dict[str, dict]) -> str | None:
    """The one-line refusal of a sweep an older release started that this one cannot go on with (None: none).

    - A folder of qed_ray 0.1, which trained a sweep's trials outside packs (their own ``checkpoints/<trial>/`` and
      ``tune/<start>/<trial>/``; ``layout`` None: not looked at).
    - A ``sweep.json`` of format < 3 (``fmt``; its trials' identities ``recorded``) holding QED trials: written before
      ``temperature.target_alpha`` defaulted to ``floor``, their names were given under the old default (``qed0.2``
      then meant target_alpha: qed), so today's names would mean another setting.
    """
    way_out = "or start over with --fresh or another name"
    if layout is not None and (old := _unpacked_trial(layout)):
        return (f"sweep_dir: {layout.root} was started by qed_ray 0.1, which trained its trials outside packs "
                f"({old.relative_to(layout.root)}); this release does not resume it: finish it with qed_ray 0.1, "
                f"{way_out}")
    qed = [n for n, i in recorded.items() if i.get("temperature.kind") == "qed"]
    if fmt >= 3 or not qed:
        return None
    return (f"temperature.target_alpha: this sweep.json predates the default target_alpha: floor (paper App. C), and "
            f"its {len(qed)} QED trial(s) (e.g. {qed[0]}) were named under the old default qed, so their names now "
            f"mean another setting: finish them with the release that started them, {way_out}")


def _unpacked_trial(layout: SweepDir) -> Path | None:
    """A trial's own checkpoint or Tune folder, which only qed_ray 0.1 wrote (every run is a pack since, its folders
    named by the pack's); None when there is none."""
    tune = sorted(layout.tune_root.iterdir()) if layout.tune_root.is_dir() else []
    for root in [layout.root / "checkpoints", *tune]:
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            try:
                parse_trial_dirname(d.name)
                return d
            except ValueError:
                continue
    return None


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


def _claim_mac(key: bytes, sweep: str, record: ClaimRecord) -> str:
    return sign(key, "claim", sweep, record.file, record.sha256)


def sign_claim(state: SweepState, key: bytes) -> SweepState:
    """``state`` with its claim record signed under ``key`` (the driver's, before it writes ``sweep.json``)."""
    if state.claim is None:
        return state
    signed = state.claim.model_copy(update={"signature": _claim_mac(key, state.sweep_id, state.claim)})
    return state.model_copy(update={"claim": signed})


def verified_claim(state: SweepState, key: bytes | None) -> dict | None:
    """The claim record the re-analysis judges by: the block recomputed against its frozen SHA-256, the record's
    signature checked under ``key`` (None: ``--no-verify``, unchecked), and the block of the claim file itself
    where it can be read here (it must hash to the frozen SHA-256); None when the sweep names no claim. Raises
    SpecError naming the field: an edited block (and each changed field where the claim file can be read), a
    record without the key's signature, a claim file changed since the sweep started."""
    rec = state.claim
    if rec is None:
        return None
    try:
        raw = claim_file.read_block(rec.file)[1]
    except claim_file.ClaimError:
        raw = None  # the re-analysis may run where the claim file is not: the signed block stands for it
    problem = _claim_problem(state.sweep_id, rec, raw, key)
    if problem:
        raise SpecError(problem)
    return {"file": rec.file, "sha256": rec.sha256, "block": raw if raw is not None else rec.block}


def _claim_problem(sweep: str, rec: ClaimRecord, raw: dict | None, key: bytes | None) -> str | None:
    edited = claim_file.stored_block_edited(rec.model_dump(), raw, rec.file)
    if edited:
        return f"sweep.json: {edited}"
    if key is not None and rec.signature is None and raw is None:
        return (f"sweep.json: claim.signature: the claim record is unsigned (an older release wrote it) and its claim "
                f"file {rec.file} cannot be read here to check it: re-analyse from the folder that path is relative "
                f"to, or start the sweep once (a start signs it)")
    if key is not None and rec.signature is not None and not hmac.compare_digest(rec.signature,
                                                                                 _claim_mac(key, sweep, rec)):
        return (f"sweep.json: claim.signature: the claim record ({rec.file}, block sha256 {rec.sha256[:12]}) does not "
                f"carry your results key's signature: it was edited in the folder, or the sweep ran with another key")
    if raw is not None and claim_file.block_sha256(raw) != rec.sha256:
        return (f"claim: {rec.file}: the claim block changed since this sweep started "
                f"({'; '.join(claim_file.changed_fields(rec.block, raw))}): a sweep's pre-registration cannot "
                f"change: restore the block")
    return None


PID_MAX = 2**22  # Linux's ceiling on pids (PID_MAX_LIMIT); a larger one is no process of any host
TIME_MAX = 2**33  # seconds since the epoch (year 2242): a later start or heartbeat is a damaged record


class LockInfo(Record):
    """The content of a lock file."""

    host: str = Field(min_length=1)
    pid: int = Field(ge=1, le=PID_MAX)
    started: float = Field(ge=0, le=TIME_MAX)
    heartbeat: float = Field(ge=0, le=TIME_MAX)
    token: str = Field(min_length=1)

    def describe(self, now: float) -> str:
        """``pid 123 on host h (started 2026-01-01 12:00:00, last heartbeat 12 s ago)``."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"pid {self.pid} on host {self.host} (started {started}, last heartbeat "
                f"{max(now - self.heartbeat, 0):.0f} s ago)")
