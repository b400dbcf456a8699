"""The sweep folder before anything runs: where it is, whether it may be used, and which trials it already holds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qed_ray.spec import claim
from qed_ray.analysis.results import FailedTrial
from qed_ray.records.codec import RecordError
from qed_ray.records.layout import PackId, SweepDir, TrialId
from qed_ray.spec.naming import SEP, format_value, identity, identity_changes, show_setting
from qed_ray.records.digests import unverified_reason
from qed_ray.records.run import diverged_reason, read_history
from qed_ray.service.packing import Pack, form_packs, pack_of, pack_records, pack_started, pack_state
from qed_ray.records.sweep import STATE_FORMAT, StateDamaged, SweepState, older_release, read_state
from qed_ray.service.mlflow.tags import DIGEST_TAG, UNVERIFIED_TAG
from qed_ray.service.mlflow.tracking_uri import URI_ENV, check_uri, default_tracking_uri
from qed_ray.spec.sweep import SpecError, SweepSpec

if TYPE_CHECKING:  # MLflow is imported by a start that syncs runs, not by --status or --dry-run
    from qed_ray.service.mlflow.tracking import Tracker
STORAGE_ROOT_ENV = "QED_STORAGE_ROOT"  # resolves a relative storage_path (required for one under `ray job submit`)
STORAGE_PATH_ENV = "QED_STORAGE_PATH"  # overrides the spec's storage_path
# What `ray job submit` needs to bring the storage root into the job: the shell's $PWD, expanded when submitted.
RUNTIME_ENV_JSON = f"""--runtime-env-json '{{"env_vars": {{"{STORAGE_ROOT_ENV}": "'"$PWD"'"}}}}'"""
# Folders a sweep must never be put in (nor anywhere inside them), and folders it must not be put directly into.
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/proc", "/sys",
                "/dev", "/run", "/var")
SYSTEM_FOLDERS = ("/", "/home", "/root", "/opt", "/srv", "/mnt", "/media", "/tmp")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")  # file:/x, s3:bucket: a URI, never a folder of ours


# ---- where the sweep folder is ---------------------------------------------------------------------------
def in_ray_job() -> bool:
    """Whether this process is the driver of a ``ray job submit`` job (its cwd is Ray's per-job package cache)."""
    return "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ or "runtime_resources" in Path.cwd().parts


def storage_root(spec: SweepSpec) -> Path:
    """The absolute storage root: ``QED_STORAGE_PATH`` or ``storage_path``, a relative one against
    ``QED_STORAGE_ROOT`` (else the current folder, except in a Ray job); raises SpecError naming the field."""
    env = os.environ.get(STORAGE_PATH_ENV)
    raw, fld = (env, STORAGE_PATH_ENV) if env else (spec.storage_path, "storage_path")
    if "://" in raw or _SCHEME.match(raw):
        # Policy snapshots, replay chunks and markers are plain files read by every node; object stores would need
        # a filesystem layer this version does not have.
        raise SpecError(f"{fld}: {raw!r} is a URI; give a filesystem path (on a cluster: a shared mount such as "
                        f"EFS/NFS, Filestore or a ReadWriteMany volume, mounted at the same path on every node)")
    path = Path(raw).expanduser()
    if not path.is_absolute():
        base = os.environ.get(STORAGE_ROOT_ENV)
        if base and not Path(base).expanduser().is_absolute():
            raise SpecError(f"{STORAGE_ROOT_ENV}: {base!r} must be an absolute path")
        if base:
            path = Path(base).expanduser() / path
        elif in_ray_job():
            raise SpecError(relative_in_job(raw, fld, Path.cwd()))
        else:
            path = Path.cwd() / path
    path = path.resolve()
    _refuse_system_folder(path, raw, fld)
    _refuse_file(path, raw, fld)
    return path


def _refuse_file(path: Path, raw: str, fld: str) -> None:
    """The storage root, or the nearest part of it that exists, must be a folder (a file there would fail the
    start's first write)."""
    existing = next(p for p in (path, *path.parents) if os.path.exists(p))  # False, not an error, where unreadable
    if not os.path.isdir(existing):
        raise SpecError(f"{fld}: {raw!r} resolves to {path}, but {existing} is a file, not a folder; give a folder "
                        f"(or a path that does not exist yet)")


def relative_in_job(raw: str, fld: str, cwd: Path) -> str:
    """The refusal of a relative storage path in a Ray job without ``QED_STORAGE_ROOT``: the job's real working
    folder, and the ``--runtime-env-json`` that brings the root into the job (the submitting shell's variables stay
    there)."""
    if "runtime_resources" in cwd.parts:
        where = (f"Ray's per-job copy of --working-dir ({cwd}): Ray deletes it, and the next submission gets a new "
                 f"one and would start over")
    else:
        where = f"the folder the Ray head was started in ({cwd}), not the folder the job was submitted from"
    return (f"{fld}: {raw!r} is relative, and this Ray job's working folder is {where}.\n"
            f"Give the job a storage root: run `ray job submit` from the folder results belong under, adding\n"
            f"  {RUNTIME_ENV_JSON}\n"
            f"({STORAGE_ROOT_ENV} exported in the submitting shell does not reach the job; on a cluster, give a "
            f"shared mount, or an absolute storage_path / {STORAGE_PATH_ENV})")


def _refuse_system_folder(path: Path, raw: str, fld: str) -> None:
    home = Path.home().resolve()
    trees = {Path(t).resolve() for t in SYSTEM_TREES}  # /bin -> /usr/bin on merged-/usr systems
    what = None
    if path == home:
        what = "your home folder itself"
    elif path in {Path(f).resolve() for f in SYSTEM_FOLDERS} or path in trees:
        what = "a system folder" if path != Path("/") else "the filesystem root"
    elif any(t in path.parents for t in trees):
        what = f"inside the system folder {next(t for t in sorted(trees) if t in path.parents)}"
    if what:
        raise SpecError(f"{fld}: {raw!r} resolves to {path}, {what}; a sweep writes many files into its storage "
                        f"folder: give a folder of its own (e.g. results, or /mnt/qed/sweeps on a cluster)")


def resolve_paths(spec: SweepSpec) -> tuple[SweepDir, str, str]:
    """The sweep folder, tracking URI and experiment (env vars override the spec's storage and URI); raises
    SpecError for a URI with credentials or one this service cannot use (:mod:`qed_ray.service.mlflow.tracking_uri`),
    also for the spec's when the environment overrides it (the spec is stored with the sweep)."""
    for uri, fld in ((spec.tracking.uri, "tracking.uri"), (os.environ.get(URI_ENV), URI_ENV)):
        if uri:
            check_uri(uri, fld)
    layout = SweepDir(storage_root(spec) / spec.name)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.tracking.uri or default_tracking_uri(layout.root)
    return layout, uri, spec.tracking.experiment or spec.name


# ---- is the folder ours ------------------------------------------------------------------------------------
def check_folder(layout: SweepDir, spec: SweepSpec, fresh: bool = False, force: bool = False) -> SweepState | None:
    """Refuses a folder that is not this sweep's (before anything is written); returns its state, if any. With
    ``fresh`` (``--fresh``) a ``sweep.json`` that cannot be read cannot name this sweep, so it is refused unless
    ``force`` confirms moving the folder aside unchecked (then it counts as no state)."""
    root = layout.root
    if root.exists() and not root.is_dir():
        raise SpecError(f"storage_path: {root} exists and is not a folder")
    # A k search's points (search.json) are written before its first start makes the folder a sweep's.
    if not root.exists() or not [p for p in root.iterdir() if p.name not in (layout.lock_file.name,
                                                                             layout.search_file.name)]:
        return None
    try:
        state = read_state(layout)
    except StateDamaged as e:
        if fresh and force:
            return None
        if fresh:
            raise SpecError(f"{e.problem}; --fresh cannot check that this folder holds the sweep {spec.name!r}: add "
                            f"--force to move it aside anyway (nothing is deleted)") from None
        raise
    if state is None:
        raise SpecError(f"storage_path: {root} already holds files but no sweep.json, so it is not a sweep folder; "
                        f"refusing to write into it (choose another name or storage_path)")
    if (state.name or spec.name) != spec.name:
        raise SpecError(f"name: {root} holds the sweep {state.name!r}, not {spec.name!r} (a backup made by "
                        f"--fresh?); choose another name")
    return state


def move_aside(layout: SweepDir) -> Path:
    """``--fresh``: moves everything but the lock into ``<name>.old-<YYYYmmdd-HHMMSS>`` beside the folder, sweep.json
    last (so a crash midway leaves a sweep folder that ``--fresh`` can move again); returns the backup."""
    root = layout.root
    backup = root.with_name(f"{root.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
    while backup.exists():
        backup = backup.with_name(f"{backup.name}-{uuid.uuid4().hex[:4]}")
    backup.mkdir()
    keep = {layout.lock_file.name, layout.state_file.name}
    last = [layout.state_file] if os.path.lexists(layout.state_file) else []
    for entry in [p for p in root.iterdir() if p.name not in keep] + last:
        os.rename(entry, backup / entry.name)
    return backup


# ---- which trials it holds ---------------------------------------------------------------------------------
def trial_identities(spec: SweepSpec) -> dict[str, dict[str, Any]]:
    """``{trial name: identity}`` of the spec's trials, as JSON would store them."""
    return {t.name: json.loads(json.dumps(identity(t.run))) for t in spec.trials()}


@dataclass
class Plan:
    """What a start will do: the sweep's state and the trials by what they need (names in grid order)."""

    state: SweepState
    new: list[str] = field(default_factory=list)  # not in the sweep yet
    problems: list[str] = field(default_factory=list)  # refusals, one line each, each naming its field
    packs: list[Pack] = field(default_factory=list)  # the Tune trials


def plan(state: SweepState | None, spec: SweepSpec, layout: SweepDir | None = None) -> Plan:
    """Compares the spec with ``sweep.json`` (None: a new sweep); the returned state records every trial.

    With ``layout``, recorded trials that never started (nothing of theirs in the folder, say after a start that
    was refused by a cluster check) are not held to their recorded identity: they may change or be dropped.
    """
    current = trial_identities(spec)
    if state is None:
        state = SweepState(sweep_id=uuid.uuid4().hex[:12], created=time.time(), trials={})
    recorded = state.trials
    if recorded is None:  # written before per-trial identities: only an unchanged grid can be checked
        if state.fingerprint != spec.fingerprint():
            return Plan(state, problems=["trials: the spec's grid changed since this sweep started, and its "
                                         "sweep.json predates per-trial identities, so the change cannot be "
                                         "named; restore the spec, or start over with --fresh or another name"])
        recorded = dict(current)
    if layout is not None:
        recorded = {n: i for n, i in recorded.items() if _started(layout, n)}
    if old := older_release(layout, state.format, recorded):
        return Plan(state, problems=[old])
    new = [n for n in current if n not in recorded]
    packs, pack_problems = _plan_packs(state, spec, bool(recorded), layout)
    old_claim = state.claim.model_dump() if state.claim is not None else None
    claim_record, claim_problems = claim.check(old_claim, spec.claim, bool(recorded))
    # The pre-registration is frozen at the first start (qed_ray.spec.claim); None when the spec names no claim file.
    state = SweepState.model_validate({
        "sweep_id": state.sweep_id, "created": state.created, "format": STATE_FORMAT, "name": spec.name,
        "fingerprint": spec.fingerprint(), "trials": {**recorded, **{n: current[n] for n in new}},
        "pack_seeds": spec.pack.seeds, "pack_by": spec.pack.by, "packs": pack_records(packs), "claim": claim_record,
        "spec": spec.model_dump(mode="json")})
    return Plan(state, new, _problems(recorded, current, spec) + pack_problems + claim_problems, packs)


def _plan_packs(state: SweepState, spec: SweepSpec, started: bool, layout: SweepDir | None
                ) -> tuple[list[Pack], list[str]]:
    """The sweep's packs (recorded ones kept as they are, see :mod:`qed_ray.service.packing`) and the refusal of a
    changed pack size or packing (``pack.by``) once anything started. A recorded pack that never started (nothing
    of it in the folder) may re-form."""
    old, recorded = state.pack_seeds, state.packs
    if layout is not None:
        recorded = {n: m for n, m in recorded.items() if pack_started(layout, PackId.of(m))}
    if old != spec.pack.seeds and recorded:
        shown = form_packs(spec)  # what --dry-run lists beside the refusal
        return shown, [f"pack.seeds: this sweep trains packs of {old} seed{'s' if old > 1 else ''}, the spec now gives "
                       f"{spec.pack.seeds}; a started pack's checkpoint holds its seeds together, so a sweep's pack "
                       f"size cannot change: restore pack.seeds: {old}, or start over with --fresh or another name"]
    by = state.pack_by
    if by != spec.pack.by and spec.pack.seeds > 1 and (recorded or started):  # packs of one: alike either way
        return form_packs(spec), [f"pack.by: this sweep packs by {by}, the spec now gives {spec.pack.by}; a started "
                                  f"pack's checkpoint holds its members together: restore pack.by: {by}, or start "
                                  f"over with --fresh or another name"]
    return form_packs(spec, recorded), []


def _started(layout: SweepDir, name: str) -> bool:
    """Whether the trial left anything of its own in the folder (a policy or replay folder)."""
    return any(p.exists() for p in (layout.policies(name), layout.replay(name)))


def _problems(recorded: dict, current: dict, spec: SweepSpec) -> list[str]:
    changed: dict[str, list] = {}  # setting -> [(trial, old, new)]
    for name in [n for n in recorded if n in current]:
        for setting, (old, new) in identity_changes(recorded[name], current[name]).items():
            changed.setdefault(setting, []).append((name, old, new))
    gone = [n for n in recorded if n not in current]
    renamed = _renamed(gone, recorded, current)
    added = [current[n] for n in current if n not in recorded]
    twins = {n: _closest(recorded[n], added) for n in gone if n not in renamed}
    for name, twin in twins.items():  # the same task/agent/seed with other settings: name what changed
        for setting, (old, new) in (identity_changes(recorded[name], twin) if twin else {}).items():
            changed.setdefault(setting, []).append((name, old, new))
    lines = []
    for setting, rows in sorted(changed.items()):
        olds, news = sorted({show_setting(r[1]) for r in rows}), sorted({show_setting(r[2]) for r in rows})
        lines.append(f"{setting}: this sweep's {len(rows)} trial(s) ran with {', '.join(olds)} (e.g. {rows[0][0]}), "
                     f"the spec now gives {', '.join(news)}; a sweep's trials cannot change: restore the value, or "
                     f"start over with --fresh or another name")
    lines += _rename_lines(renamed, recorded)
    dropped = [n for n, twin in twins.items() if twin is None]
    if dropped:
        fld = _dropped_field(TrialId.from_name(dropped[0]), spec)
        lines.append(f"{fld}: the spec no longer has {len(dropped)} trial(s) of this sweep (e.g. {dropped[0]}); a "
                     f"sweep only grows: add them back, or start over with --fresh or another name")
    return lines


def _renamed(gone: list[str], recorded: dict, current: dict) -> dict[str, str]:
    """``{old name: new name}`` of trials whose identity is unchanged but whose name is not."""
    by_identity = {json.dumps(i, sort_keys=True): n for n, i in current.items() if n not in recorded}
    return {n: by_identity[k] for n in gone if (k := json.dumps(recorded[n], sort_keys=True)) in by_identity}


def _rename_lines(renamed: dict[str, str], recorded: dict) -> list[str]:
    axes: dict[str, list] = {}
    for old, new in renamed.items():
        before, after = (_label_settings(TrialId.from_name(n).variant, recorded[old]) for n in (old, new))
        for setting in sorted(before ^ after) or ["agents"]:
            axes.setdefault(setting, []).append((old, new, setting in after))
    return [f"{setting}: {'now' if rows[0][2] else 'no longer'} a grid axis, so {len(rows)} trial(s) of this sweep "
            f"would be renamed (e.g. {rows[0][0]} -> {rows[0][1]}) and lose their checkpoints and MLflow runs; keep "
            f"{setting} as it was for this sweep, or start over with --fresh or another name"
            for setting, rows in sorted(axes.items())]


def _label_settings(variant: str, identity: dict) -> set[str]:
    """The agent and training settings of ``identity`` that ``variant`` names (``+leaf=value``, as variant_label
    writes a grid axis)."""
    return {k for k, v in identity.items() if k.startswith(("agent.", "train."))
            and f"{SEP}{k.split('.', 1)[1]}={format_value(v)}{SEP}" in variant + SEP}


def _closest(old: dict, candidates: list[dict]) -> dict | None:
    """The candidate of the same task, agent and seed with the fewest changed settings (None if there is none)."""
    same = [c for c in candidates if all(c.get(k) == old.get(k) for k in ("task", "agent", "seed"))]
    return min(same, key=lambda c: len(identity_changes(old, c)), default=None)


def _dropped_field(trial: TrialId, spec: SweepSpec) -> str:
    if trial.task not in spec.tasks:
        return "tasks"
    if trial.seed not in spec.seeds:
        return "seeds"
    return "agents"


# ---- what the folder holds after training ---------------------------------------------------------------
def outcome(layout: SweepDir, spec: SweepSpec, failed: dict[str, str]) -> tuple[list[FailedTrial], list[str]]:
    """From the folder: the failed trials with their reasons (diverged, or given up by Tune in this start:
    ``failed``, ``{trial: error}``) and the names of the unfinished ones (to resume), in grid order."""
    failures, unfinished = [], []
    for t in spec.trials():
        state, name = layout.trial_state(t.name), t.name
        if state == "diverged":
            failures.append(FailedTrial(name, diverged_reason(layout, name)))
        elif state == "pending" and name in failed:
            failures.append(FailedTrial(name, failed[name]))
        elif state == "pending":
            unfinished.append(name)
    return failures, unfinished


def prune_finished(layout: SweepDir, packs: list[Pack], keep_replay: bool) -> list[str]:
    """Deletes the replay chunks of the packs that have ended (each seed run done or diverged), unless
    ``keep_replay``, also of packs whose worker ended before it could; returns the finished trials. A pack with a
    seed run still pending keeps every seed's replay: its newest checkpoint may need them to resume."""
    from qed_ray.rl.replay import prune_chunks  # torch: a start's, not --status's

    ended = [p for p in packs if pack_state(layout, p) == "ended"]
    for name in [n for p in ended for n in p.names] if not keep_replay else []:
        prune_chunks(layout.replay(name))
    return [n for p in packs for n in p.names if layout.trial_state(n) == "done"]


def sqlite_on_many_machines(uri: str, nodes: list[dict]) -> str | None:
    """The refusal of a SQLite store when Ray's ``nodes`` span more than one machine (SQLite's locking is not
    reliable over NFS); None otherwise (one machine: its nodes share a local disk)."""
    hosts = sorted({n.get("NodeManagerAddress", "") for n in nodes})
    if not uri.startswith("sqlite:") or len(hosts) < 2:
        return None
    return (f"tracking.uri: a SQLite store ({uri}) on a cluster of {len(hosts)} machines: every node would write to "
            f"one SQLite file over the network, where its locking is not reliable; run an MLflow tracking server and "
            f"set MLFLOW_TRACKING_URI=http://<head>:5000 (see cluster/README.md)")


def sync_runs(tracker: Tracker, parent_run_id: str, layout: SweepDir, spec: SweepSpec,
              failures: list[FailedTrial], unfinished: list[str], packs: list[Pack]) -> list[FailedTrial]:
    """Brings every trial's MLflow run in line with the folder: finished runs complete (metrics an outage kept
    back, a store that moved; tagged ``qed.unverified`` when their worker could not record its digest), failed ones
    FAILED with the reason, unfinished ones KILLED (to be resumed). Runs already in that state are not touched.
    Best-effort: if MLflow fails, the next call (the end of this start, or the next start) tries again. A seed run
    carries its pack's tags. Returns the trials whose ``history.json`` or ``DONE.json`` is damaged, each with the
    file and the problem: their runs end without what those files hold, the other trials' runs are synced."""
    from qed_ray.service.mlflow.tracking import TrialRun, pack_tags

    try:
        runs = tracker.trial_runs()
    except Exception as e:  # noqa: BLE001 - MLflow is a mirror; the folder keeps everything
        print(f"WARNING: MLflow unreachable ({type(e).__name__}); the trials' runs are synced at the end of this "
              f"start or at the next one", flush=True)
        return []
    damaged = []
    reasons = {f.name: f.error for f in failures}
    in_pack = pack_of(packs)
    for t in spec.trials():
        run = runs.get(t.name)
        status = run.info.status if run is not None else None
        want = "KILLED" if t.name in unfinished else "FAILED" if t.name in reasons else "FINISHED"
        tags, history = {}, []
        try:
            tags = _unverified(layout, t.name, run) if want == "FINISHED" else {}
            if not tags and (status == want or (want == "KILLED" and status in (None, "FINISHED"))):
                continue
            history = read_history(layout, t.name)
        except RecordError as e:  # its run still ends (with what could be read), the others are synced
            print(f"WARNING: {t.name}: {e}", flush=True)
            damaged.append(FailedTrial(t.name, str(e)))
            if status == want and not tags:
                continue
        pack = in_pack[t.name]
        mirror = TrialRun(tracker.uri, tracker.experiment, tracker.sweep_id, parent_run_id, t.name,
                          t.run.model_dump(mode="json"), log=lambda line: print(line, flush=True),
                          run_tags=pack_tags(pack.name, len(pack.trials)))
        if not mirror.finish(history, failed_reason=reasons.get(t.name), killed=want == "KILLED", tags=tags,
                             timeout_s=30):
            return damaged
    return damaged


def _unverified(layout: SweepDir, name: str, run) -> dict[str, str]:
    """The ``qed.unverified`` tag for a finished trial whose run lacks the digest only its worker records, with the
    reason its ``DONE.json`` gives (:func:`~qed_ray.records.digests.unverified_reason`), unless the run has either tag
    already; else ``{}``. Raises RecordError for a damaged ``DONE.json`` (the caller reports it)."""
    tags = run.data.tags if run is not None else {}
    if layout.trial_state(name) != "done" or DIGEST_TAG in tags or UNVERIFIED_TAG in tags:
        return {}
    return {UNVERIFIED_TAG: f"{unverified_reason(layout, name)}; the gather step uses its files unchecked and "
                            f"reports them unverified"}


def git_sha() -> str:
    """The commit of the code this driver runs (``unknown`` outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
