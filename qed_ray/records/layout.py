"""The sweep folder's layout: the one place that names its files and folders."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence


SEP = "__"  # between the parts of a trial folder name; never inside a task, agent or variant
SEED_PREFIX = "s"
PACK_PREFIX = "pack"
PACK_FILE = "pack.json"  # written last into a pack checkpoint: its presence marks a complete one
PACK_FORMAT = 1  # pack.json's format (qed_ray.records.manifests.PackRecord)
STATE_FILE = "state.pt"  # a checkpoint's or policy snapshot's tensors (qed_ray.records.checkpoint)
MANIFEST_FILE = "manifest.json"  # written last into a checkpoint or snapshot: its presence marks a complete one
REANALYSIS_PREFIX = "reanalysis-"  # gather/reanalysis-<settings>/: a re-analysis's outputs, beside the sweep's own
SNAPSHOT_DIGITS = 10  # policy snapshot folders are zero-padded env steps, so they sort by name

# Each entry of docs/results.md's "Sweep folder" table (relative to the sweep folder, placeholders in <>) with the
# SweepDir member that builds it; tests/records/test_layout.py checks the table and the members against this.
DOCUMENTED: dict[str, str] = {
    "sweep.json": "state_file",
    "sweep.lock": "lock_file",
    "looks.json": "looks_file",
    "search.json": "search_file",
    "checkpoints/<pack>/<env_steps>/": "pack_checkpoint",
    "policies/<trial>/<env_steps>/": "snapshot",
    "policies/<trial>/history.json": "history",
    "policies/<trial>/DONE.json": "done_marker",
    "policies/<trial>/DIVERGED.json": "diverged_marker",
    "replay/<trial>/": "replay",
    "tune/<start>/<task>__<agent>__<variant>__pack<seeds>/": "pack_dir",
    "gather/results.json": "results_json",
    "gather/aggregates.csv": "aggregates_csv",
    "gather/groups.csv": "groups_csv",
    "gather/iqm_by_budget.csv": "budgets_csv",
    "gather/comparisons.csv": "comparisons_csv",
    "gather/verdict.json": "verdict_json",
    "gather/figures/": "figures",
    "gather/cache/<key>.json": "cached_group",
    "gather/behaviour/": "behaviour",
    "gather/policy_<policy>/": "policy_gather",
    "gather/reanalysis-<settings>/": "reanalysis",
    "gather/search/": "search_outputs",
    "mlflow.db": "mlflow_db",
    "mlartifacts/": "mlartifacts",
}


class TrialId(NamedTuple):
    """The parts of a trial name ``task/agent/variant/seed`` (the variant is an opaque label)."""

    task: str
    agent: str
    variant: str
    seed: int

    @property
    def name(self) -> str:
        """The trial name ``task/agent/variant/seed``."""
        return f"{self.task}/{self.agent}/{self.variant}/{self.seed}"

    @property
    def dirname(self) -> str:
        """The folder name ``task__agent__variant__sSEED``."""
        return SEP.join((self.task, self.agent, self.variant, f"{SEED_PREFIX}{self.seed}"))

    @classmethod
    def from_name(cls, name: str) -> "TrialId":
        """Parses ``task/agent/variant/seed``; raises ValueError naming what is wrong."""
        parts = name.split("/")
        if len(parts) != 4 or not parts[3].isdigit():
            raise ValueError(f"trial name: {name!r} is not 'task/agent/variant/seed' (seed a number >= 0)")
        trial = cls(parts[0], parts[1], parts[2], int(parts[3]))
        # Folder names split task and agent off the left at the first "__": neither may hold "__" or end in "_".
        bad = [f for f in ("task", "agent", "variant") if not getattr(trial, f) or SEP in getattr(trial, f)
               or (f != "variant" and getattr(trial, f).endswith("_"))]
        if bad:
            raise ValueError(f"trial name: {name!r}: {' and '.join(bad)} must be non-empty and hold no {SEP!r} "
                             f"(task and agent may not end in '_')")
        return trial


def seeds_label(seeds: Sequence[int]) -> str:
    """``0-9`` for consecutive ascending seeds (``5`` for one), else ``0+3+7``."""
    seeds = list(seeds)
    if len(seeds) > 1 and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return "+".join(map(str, seeds))


class PackId(NamedTuple):
    """A pack: the seed runs ``task/agent/variant/<seed>`` of ``seeds`` trained together in one Tune trial.

    A pack by shape (``pack.by: shape``) holds several variants of one task and agent: ``variants`` then names
    each member's variant (in pack order, beside ``seeds``) and ``variant`` is their list, ``qed0.1,qed0.2``.
    """

    task: str
    agent: str
    variant: str
    seeds: tuple[int, ...]
    variants: tuple[str, ...] = ()  # per member, for a pack of several variants; () when all are ``variant``

    @property
    def label(self) -> str:
        """``pack0-2``; a pack of several variants labels each variant's seeds in turn (``pack0-9``, when they
        all have the same ones, else ``pack0-9,0-4``)."""
        if not self.variants:
            return f"{PACK_PREFIX}{seeds_label(self.seeds)}"
        per: dict[str, list[int]] = {}
        for v, s in zip(self.variants, self.seeds):
            per.setdefault(v, []).append(s)
        labels = list(dict.fromkeys(seeds_label(s) for s in per.values()))
        return f"{PACK_PREFIX}{labels[0] if len(labels) == 1 else ','.join(seeds_label(s) for s in per.values())}"

    @property
    def name(self) -> str:
        """``task/agent/variant/pack0-2`` (the Tune trial's name, the ``qed.pack`` tag of its seeds' runs)."""
        return f"{self.task}/{self.agent}/{self.variant}/{self.label}"

    @property
    def dirname(self) -> str:
        """``task__agent__variant__pack0-2`` (never a trial folder name: it does not end in ``__s<seed>``)."""
        return SEP.join((self.task, self.agent, self.variant, self.label))

    @property
    def trials(self) -> list[str]:
        """The trial names of its seed runs, in pack order."""
        variants = self.variants or (self.variant,) * len(self.seeds)
        return [TrialId(self.task, self.agent, v, s).name for v, s in zip(variants, self.seeds)]

    @classmethod
    def of(cls, trials: Sequence[str]) -> "PackId":
        """The pack of these trial names (one task and agent; distinct runs, in this order); raises ValueError
        naming what differs. Whether the runs' settings may share a pack is :func:`qed_ray.rl.pack.check_pack`'s."""
        ids = [TrialId.from_name(n) for n in trials]
        if not ids:
            raise ValueError("pack: no trials")
        for field in ("task", "agent"):
            other = next((n for n, t in zip(trials, ids) if getattr(t, field) != getattr(ids[0], field)), None)
            if other is not None:
                raise ValueError(f"pack: {trials[0]!r} and {other!r} differ in {field}: a pack holds runs of one "
                                 f"task and agent")
        seeds = tuple(t.seed for t in ids)
        variants = tuple(dict.fromkeys(t.variant for t in ids))
        if len(variants) == 1:
            if len(set(seeds)) != len(seeds):
                raise ValueError(f"pack: seeds {list(seeds)} repeat a seed")
            return cls(*ids[0][:3], seeds)
        if len(set(ids)) != len(ids):
            raise ValueError(f"pack: {next(n for n in trials if trials.count(n) > 1)!r} is in it twice")
        return cls(ids[0].task, ids[0].agent, ",".join(variants), seeds, tuple(t.variant for t in ids))


def seed_dir(seed: int) -> str:
    """The folder of one seed's checkpoint (the single-seed layout) inside a pack checkpoint."""
    return f"seed_{seed}"


def member_dirs(names: Sequence[str], seeds: Sequence[int]) -> list[str]:
    """Each member's folder inside a pack checkpoint, in pack order: :func:`seed_dir` when the seeds are distinct
    (every pack of one variant), else its trial folder name (a pack by shape holds seed s of several variants)."""
    if len(set(seeds)) == len(seeds):
        return [seed_dir(s) for s in seeds]
    return [trial_dirname(n) for n in names]


def trial_dirname(name: str) -> str:
    """Folder name of trial ``task/agent/variant/seed``: ``task__agent__variant__sSEED``."""
    return TrialId.from_name(name).dirname


def parse_trial_dirname(dirname: str) -> TrialId:
    """Inverse of :func:`trial_dirname` (``parse_trial_dirname(trial_dirname(n)).name == n``).

    Task and agent are split off the left and the seed off the right, so the variant in between may hold any
    character but ``/`` and ``__`` (a lone ``_`` at either end included). Raises ValueError if it is no trial folder.
    """
    left = dirname.split(SEP, 2)
    if len(left) == 3 and SEP in left[2]:
        variant, seed = left[2].rsplit(SEP, 1)
        if seed[:1] == SEED_PREFIX and seed[1:].isdigit() and "/" not in dirname:
            trial = TrialId(left[0], left[1], variant, int(seed[1:]))
            try:
                if TrialId.from_name(trial.name) == trial:
                    return trial
            except ValueError:
                pass
    raise ValueError(f"trial folder: {dirname!r} is not 'task__agent__variant__sSEED'")


@dataclass(frozen=True)
class SweepDir:
    """Every path of one sweep folder. ``name`` arguments are trial names ``task/agent/variant/seed``."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # accept str; frozen, so set once here

    # ---- the sweep --------------------------------------------------------------------------------------
    @property
    def state_file(self) -> Path:
        """``sweep.json``: the sweep's stable id, name and the identity of every trial it holds."""
        return self.root / "sweep.json"

    @property
    def looks_file(self) -> Path:
        """``looks.json``: an adaptive sweep's looks so far, each with its intervals, levels and decisions."""
        return self.root / "looks.json"

    @property
    def lock_file(self) -> Path:
        """``sweep.lock``: held by the one driver running this sweep (host, pid, start, heartbeat)."""
        return self.root / "sweep.lock"

    @property
    def tune_root(self) -> Path:
        """``tune/``: Ray Tune's folders, one per driver start (logs only; never read back to resume)."""
        return self.root / "tune"

    @property
    def policies_root(self) -> Path:
        """``policies/``: one folder of policy snapshots per trial."""
        return self.root / "policies"

    @property
    def search_file(self) -> Path:
        """``search.json``: a k search's suggested points, in order (:mod:`qed_ray.records.search`)."""
        return self.root / "search.json"

    @property
    def search_outputs(self) -> Path:
        """``gather/search/``: a k search's front (table, figure) and the spec fragment of its chosen k."""
        return self.gather / "search"

    @property
    def gather(self) -> Path:
        """``gather/``: the cross-seed metrics, tables and figures (logged to the parent MLflow run)."""
        return self.root / "gather"

    @property
    def results_json(self) -> Path:
        """``gather/results.json`` (strict JSON)."""
        return self.gather / "results.json"

    @property
    def aggregates_csv(self) -> Path:
        """``gather/aggregates.csv``: one row per (agent, variant)."""
        return self.gather / "aggregates.csv"

    @property
    def groups_csv(self) -> Path:
        """``gather/groups.csv``: one row per (task, agent, variant)."""
        return self.gather / "groups.csv"

    @property
    def budgets_csv(self) -> Path:
        """``gather/iqm_by_budget.csv``: one row per (agent, variant, env-step budget)."""
        return self.gather / "iqm_by_budget.csv"

    @property
    def comparisons_csv(self) -> Path:
        """``gather/comparisons.csv``: one row per variant against its target-entropy baseline."""
        return self.gather / "comparisons.csv"

    @property
    def verdict_json(self) -> Path:
        """``gather/verdict.json``: the claim's verdict (docs/claim.md), strict JSON."""
        return self.gather / "verdict.json"

    @property
    def figures(self) -> Path:
        """``gather/figures/``: the sweep's figures (PNG, and SVG beside each)."""
        return self.gather / "figures"

    @property
    def group_cache(self) -> Path:
        """``gather/cache/``: every evaluated group, one file per cache key."""
        return self.gather / "cache"

    def cached_group(self, key: str) -> Path:
        """The cached evaluation of one group under its key (see :mod:`qed_ray.analysis.group_cache`)."""
        return self.group_cache / f"{key}.json"

    @property
    def behaviour(self) -> Path:
        """``gather/behaviour/``: the behaviour figures of ``qed-ray visualize``."""
        return self.gather / "behaviour"

    def policy_gather(self, policy: str) -> Path:
        """``gather/policy_<policy>/``: the tables and figures of a further evaluation policy
        (``final_eval.policies`` after the first), laid out as ``gather/`` lays out the first one's."""
        return self.gather / f"policy_{policy}"

    def reanalysis(self, settings: str) -> Path:
        """``gather/reanalysis-<settings>/``: a re-analysis's tables and figures (``python -m qed_ray.gather``),
        laid out as ``gather/``; ``settings`` names what it changed (``episodes=20+bootstrap_reps=300``)."""
        return self.gather / f"{REANALYSIS_PREFIX}{settings}"

    def reanalyses(self) -> list[Path]:
        """The re-analysis folders that hold a ``results.json``, by name."""
        if not self.gather.is_dir():
            return []
        return sorted(p for p in self.gather.glob(f"{REANALYSIS_PREFIX}*") if (p / "results.json").is_file())

    @property
    def mlflow_db(self) -> Path:
        """``mlflow.db``: the default (SQLite) MLflow store."""
        return self.root / "mlflow.db"

    @property
    def mlartifacts(self) -> Path:
        """``mlartifacts/``: the default MLflow artifact root."""
        return self.root / "mlartifacts"

    # ---- one trial ---------------------------------------------------------------------------------------
    def pack_dir(self, pack: PackId, start: str) -> Path:
        """Tune's folder of a pack (its Tune trial) in driver start ``start``."""
        return self.tune_root / start / pack.dirname

    def pack_dirs(self, pack: PackId) -> list[Path]:
        """Tune's folders of the pack, one per driver start that ran it, oldest start first."""
        if not self.tune_root.is_dir():
            return []
        return [d / pack.dirname for d in sorted(self.tune_root.iterdir()) if (d / pack.dirname).is_dir()]

    def pack_checkpoints(self, pack: PackId) -> Path:
        """A pack's checkpoints: ``pack.json`` and one ``seed_<seed>/`` per seed in the single-seed layout."""
        return self.root / "checkpoints" / pack.dirname

    def pack_checkpoint(self, pack: PackId, env_steps: int) -> Path:
        """A pack's checkpoint at ``env_steps`` (zero-padded, so folders sort by step)."""
        return self.pack_checkpoints(pack) / f"{int(env_steps):0{SNAPSHOT_DIGITS}d}"

    def pack_checkpoint_steps(self, pack: PackId) -> dict[int, Path]:
        """``{env_steps: folder}`` of the pack's complete checkpoints (``pack.json`` present), ascending."""
        return _complete_steps(self.pack_checkpoints(pack), PACK_FILE)

    def policies(self, name: str) -> Path:
        """The trial's policy snapshot folder."""
        return self.policies_root / trial_dirname(name)

    def snapshot(self, name: str, env_steps: int) -> Path:
        """The trial's policy snapshot at ``env_steps`` (zero-padded, so folders sort by step)."""
        return self.policies(name) / f"{int(env_steps):0{SNAPSHOT_DIGITS}d}"

    def done_marker(self, name: str) -> Path:
        """Written (atomically) with the final metrics when the trial has finished."""
        return self.policies(name) / "DONE.json"

    def diverged_marker(self, name: str) -> Path:
        """Written when the trial diverged (NaN/inf): its reason and env step. The trial is final, never retried."""
        return self.policies(name) / "DIVERGED.json"

    def history(self, name: str) -> Path:
        """The trial's metrics at every evaluation so far, each with the time it was recorded: what its MLflow run
        mirrors (:func:`qed_ray.records.run.read_history`; the gather step and ``--status`` read the evaluation
        history in the snapshot manifests)."""
        return self.policies(name) / "history.json"

    def trial_state(self, name: str) -> str:
        """``done`` (DONE.json), ``diverged`` (DIVERGED.json) or ``pending`` (to train or resume). A marker that is
        there counts, whatever it holds (its reader names a damaged one)."""
        if os.path.lexists(self.done_marker(name)):
            return "done"
        return "diverged" if os.path.lexists(self.diverged_marker(name)) else "pending"

    def replay(self, name: str) -> Path:
        """The trial's replay chunks (append-only; a checkpoint never rewrites the buffer)."""
        return self.root / "replay" / trial_dirname(name)

    def snapshots(self, name: str) -> dict[int, Path]:
        """``{env_steps: folder}`` of the trial's complete snapshots (a checkpoint manifest present), ascending."""
        return _complete_steps(self.policies(name))

    def final_snapshot(self, name: str) -> Path:
        """The trial's snapshot with the most env steps; raises FileNotFoundError if it has none."""
        found = self.snapshots(name)
        if not found:
            raise FileNotFoundError(f"{self.policies(name)}: no complete policy snapshot (a step folder with "
                                    f"{MANIFEST_FILE})")
        return found[max(found)]

    def trials(self) -> list[TrialId]:
        """Trials with a policy folder, sorted by folder name (other folders under ``policies/`` are skipped)."""
        if not self.policies_root.is_dir():
            raise FileNotFoundError(f"sweep_dir: {self.policies_root} does not exist (not a sweep folder, or no "
                                    f"trial saved a policy)")
        out = []
        for d in sorted(p for p in self.policies_root.iterdir() if p.is_dir()):
            try:
                out.append(parse_trial_dirname(d.name))
            except ValueError:
                continue
        return out


def _complete_steps(root: Path, marker: str = MANIFEST_FILE) -> dict[int, Path]:
    """``{env_steps: folder}`` of the step folders under ``root`` that hold ``marker`` (staging folders, named
    ``.<step>.tmp-*``, never count), ascending. A damaged marker (a dangling link, say) counts: its reader names it."""
    if not root.is_dir():
        return {}
    found = {int(d.name): d for d in root.iterdir()
             if d.is_dir() and d.name.isdigit() and os.path.lexists(d / marker)}
    return dict(sorted(found.items()))
