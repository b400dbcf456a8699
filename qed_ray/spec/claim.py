"""The pre-registration of the paper's central claim: the machine-readable block of ``docs/claim.md``, read,
validated and hashed, and the record of it a sweep keeps in ``sweep.json`` (docs/claim.md, "The block")."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from qed_ray.spec.config import AGENT_SPECS, Frozen
from qed_ray.spec.field_hints import format_validation_error
from qed_ray.spec.tasks import TASKS

MIN_SEEDS = 3  # fewer seeds give no interval: with 2, every resample of distinct seeds is the same pair

BLOCK = re.compile(r"^```yaml claim[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


class ClaimError(ValueError):
    """A claim file that cannot be used; the message names the file (and the field)."""


class VRatioEndpoint(Frozen):
    """"V ratio >= 10": the median over the tasks passing their guard of te V / QED V, with its paired interval."""

    summary: Literal["median"] = Field("median", description="how the per-task ratios are summarised over tasks")
    lower_at_least: float = Field(10.0, gt=0, description="pass: the interval's lower end is at least this; fail: "
                                                          "its upper end is below it")


class IqmEndpoint(Frozen):
    """"IQM kept": IQM(QED) / IQM(te) over the tasks where te learned, with its paired interval."""

    lower_at_least: float = Field(0.95, gt=0, description="pass: the interval's lower end is at least this; fail: "
                                                          "its upper end is below it")


class TaskGuards(Frozen):
    """What every task must show before the endpoints count it (docs/claim.md, per-task guards)."""

    learned_above_random: float = Field(
        0.1, gt=0, lt=1, description="learning floor of a task: random + this x (1 - random), in normalised score, "
                                     "random being a uniform-random policy's mean score measured by the gather step")
    mean_kept: float = Field(0.95, gt=0, description="a task fails the variant when QED's mean score over te's "
                                                     "has its interval's upper end below this")


class Endpoints(Frozen):
    """The primary endpoints, the per-task guards and the decision level (defaults: the pre-registration)."""

    v_ratio: VRatioEndpoint = VRatioEndpoint()
    iqm_kept: IqmEndpoint = IqmEndpoint()
    guards: TaskGuards = TaskGuards()
    decision_confidence: float = Field(
        0.96, gt=0, lt=1, description="family-wise level of the decision: each of the m judged variants is decided "
                                      "on intervals at 1 - (1 - this) / m (Bonferroni)")
    correction: Literal["bonferroni"] = Field("bonferroni", description="the correction across judged variants")


class AdaptiveSpec(Frozen):
    """Seeds by looks (docs/claim.md, "Seeds by looks"): the verdict is judged after ``start`` seeds, then after
    every ``step`` more, up to ``max_seeds``; each look tests the pass boundaries at the level the ``spending`` rule
    allots it (:mod:`qed_ray.analysis.spending`). The looks are the design: fixed before the first start."""

    start: int = Field(ge=MIN_SEEDS, description=f"seeds at the first look ({MIN_SEEDS} or more: an interval needs "
                                                 f"{MIN_SEEDS})")
    step: int = Field(ge=1, description="seeds added to every growing group at each later look")
    max_seeds: int = Field(ge=MIN_SEEDS, description="seeds at the last look (the design's maximum)")
    spending: Literal["obrien_fleming", "pocock"] = Field(
        "obrien_fleming", description="Lan-DeMets spending of the false-pass rate across the looks")

    @model_validator(mode="after")
    def _steps(self) -> "AdaptiveSpec":
        if self.max_seeds <= self.start or (self.max_seeds - self.start) % self.step:
            raise ValueError(f"max_seeds: {self.max_seeds} must be start ({self.start}) plus a whole number (>= 1) "
                             f"of steps ({self.step}), e.g. {self.start + self.step}")
        return self

    def misfit(self, seeds: int, pack_seeds: int | str, pack_by: str) -> str | None:
        """Why a sweep of ``seeds`` seeds packed so cannot grow by these looks (None: it can), naming the field."""
        if seeds != self.max_seeds:
            return (f"seeds: {seeds} seeds, but adaptive.max_seeds is {self.max_seeds}: seeds lists the maximum's "
                    f"seeds (a count of {self.max_seeds}, or {self.max_seeds} seeds)")
        if pack_by == "shape" or pack_seeds == "auto" or self.start % pack_seeds or self.step % pack_seeds:
            return (f"pack.seeds: {pack_seeds} (by {pack_by}) with adaptive start {self.start} and step {self.step}: "
                    f"every look adds whole packs of one variant, so pack.by must be variant and pack.seeds must "
                    f"divide both")
        return None

    def looks(self) -> list[int]:
        return list(range(self.start, self.max_seeds + 1, self.step))

    def fractions(self) -> list[float]:
        """Each look's information fraction."""
        return [n / self.max_seeds for n in self.looks()]


class ClaimBlock(Frozen):
    """The design and the decision rules fixed before the runs (docs/claim.md)."""

    claim: str = Field(min_length=1, description="the claim, in one sentence")
    agent: str = Field(description="the agent whose variants are compared")
    baseline: str = Field(description="the baseline variant (target entropy)")
    variants: list[str] = Field(min_length=1, description="the QED variants judged, as sweep variant labels")
    tasks: list[str] = Field(min_length=1, description="the tasks")
    seeds: int = Field(ge=MIN_SEEDS, description="seeds per (task, variant)")
    env_steps: int = Field(gt=0, description="the training budget in env steps")
    pilot_env_steps: int = Field(gt=0, description="the budget of the pilot (read through V curves only)")
    final_episodes: int = Field(ge=1, description="final-evaluation episodes per seed (final_eval.episodes)")
    final_policies: list[Literal["mean", "sample"]] = Field(
        min_length=1, description="final_eval.policies; the first is the one the verdict reads")
    confidence: float = Field(gt=0, lt=1, description="coverage of every reported interval")
    bootstrap_reps: int = Field(ge=100, description="bootstrap resamples")
    endpoints: Endpoints = Field(description="the primary endpoints and their thresholds")
    secondary: list[str] = Field(default_factory=list, description="reported, not decided on")
    adaptive: AdaptiveSpec | None = Field(None, description="seeds by looks (None: all seeds at once); its "
                                                           "max_seeds is the design's seeds")

    @model_validator(mode="after")
    def _known(self) -> "ClaimBlock":
        if self.agent not in AGENT_SPECS:
            raise ValueError(f"agent: {self.agent!r} is not an agent ({', '.join(AGENT_SPECS)})")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ValueError(f"tasks: {bad} are not tasks of this service (qed-ray envs lists them)")
        if self.adaptive is not None and self.adaptive.max_seeds != self.seeds:
            raise ValueError(f"adaptive.max_seeds: {self.adaptive.max_seeds}, but seeds is {self.seeds}: the design "
                             f"floor counts the maximum, so the two must be equal")
        return self


def read_block(path: str | Path) -> tuple[ClaimBlock, dict]:
    """The validated block of a claim file and its raw mapping; raises :class:`ClaimError` naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ClaimError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    blocks = BLOCK.findall(text)
    if len(blocks) != 1:
        raise ClaimError(f"{path}: expected one fenced block opened by ```yaml claim, found {len(blocks)}")
    try:
        raw = yaml.safe_load(blocks[0])
    except yaml.YAMLError as e:
        raise ClaimError(f"{path}: the claim block is not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise ClaimError(f"{path}: the claim block must be a mapping")
    try:
        return ClaimBlock.model_validate(raw), raw
    except (ValidationError, ValueError) as e:
        lines = format_validation_error(e).splitlines()
        raise ClaimError("\n".join(f"{path}: claim block field {line}" for line in lines)) from None


def block_sha256(raw: dict) -> str:
    """SHA-256 of the block's canonical JSON (sorted keys): its values, not its comments or layout."""
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    return {k: v for key, value in d.items() for k, v in _flat(value, f"{prefix}{key}.").items()}


def changed_fields(old: dict, new: dict) -> list[str]:
    """``field: old -> new`` for each dotted field of the block whose value differs (absent: ``<none>``)."""
    a, b = _flat(old), _flat(new)
    show = lambda v: "<none>" if v is None else json.dumps(v)  # noqa: E731
    return [f"{k}: {show(a.get(k))} -> {show(b.get(k))}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def stored_block_edited(recorded: dict, raw: dict | None, claim_file: str | Path | None) -> str | None:
    """The refusal of a ``sweep.json`` whose frozen block no longer hashes to the sha256 frozen with it, naming each
    field that differs from the claim file's block ``raw`` (None: unreadable here); None when the block is intact."""
    stored = block_sha256(recorded["block"])
    if stored == recorded["sha256"]:
        return None
    changes = (f"{'; '.join(changed_fields(raw, recorded['block'])) or 'no field'} against {claim_file}"
               if raw is not None else "the claim file cannot be read here to name the field")
    return (f"claim.block: sweep.json's frozen claim block was edited after the first start ({changes}): its values "
            f"hash to {stored[:12]}, not to the block sha256 {recorded['sha256'][:12]} frozen with it; a sweep's "
            f"pre-registration cannot change: restore sweep.json, or start over with --fresh or another name")


def check(recorded: dict | None, claim_file: str | None, started: bool) -> tuple[dict | None, list[str]]:
    """The claim record to keep in ``sweep.json`` (or None) and the refusals, from what ``sweep.json`` recorded and
    the spec's ``claim``; ``started``: any trial of the sweep started (a pre-registration must precede it)."""
    if claim_file is None:
        if recorded is None:
            return None, []
        return recorded, [f"claim: this sweep was started against {recorded['file']} (block sha256 "
                          f"{recorded['sha256'][:12]}), the spec no longer names it: restore claim: "
                          f"{recorded['file']}, or start over with --fresh or another name"]
    try:
        _, raw = read_block(claim_file)
    except ClaimError as e:
        return recorded, [f"claim: {line}" for line in str(e).splitlines()]
    record = {"file": str(claim_file), "sha256": block_sha256(raw), "block": raw}
    if recorded is None:
        if started:
            return None, [f"claim: {claim_file} was not named when this sweep first started; a pre-registration is "
                          f"frozen at the first start: start over with --fresh or another name"]
        return record, []
    edited = stored_block_edited(recorded, raw, claim_file)
    if edited:
        return recorded, [edited]
    if recorded["sha256"] == record["sha256"]:
        return record, []  # judged by the file's block, which hashes to what the first start froze
    changes = "; ".join(changed_fields(recorded["block"], raw))
    return recorded, [f"claim: {claim_file}: the claim block changed since this sweep started ({changes}; block "
                      f"sha256 {recorded['sha256'][:12]} recorded in sweep.json, now {record['sha256'][:12]}): a "
                      f"sweep's pre-registration cannot change: restore the block, or start over with --fresh or "
                      f"another name"]


def registered_design() -> ClaimBlock:
    """The design ``docs/claim.md`` registers: what a sweep that names no claim file is measured against."""
    return ClaimBlock(
        claim="docs/claim.md", agent="mad_sac", baseline="te", variants=["qed0.2", "qed0.4"],
        tasks=["cheetah-run", "walker-walk", "hopper-hop", "finger-spin", "reacher-hard", "quadruped-walk"],
        seeds=15, env_steps=2_000_000, pilot_env_steps=500_000, final_episodes=20, final_policies=["mean", "sample"],
        confidence=0.95, bootstrap_reps=50_000, endpoints=Endpoints())
