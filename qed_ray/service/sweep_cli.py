"""The sweep service: ``python -m qed_ray.sweep SPEC`` runs, resumes or grows a sweep (here, or as a Ray job).

Module-level imports are the spec's and the standard library's: each subcommand imports what it needs after the
arguments are read (docs/design.md, layering rule 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from qed_ray.spec import cli_help, console
from qed_ray.records.codec import RecordError
from qed_ray.spec.hints import close_match
from qed_ray.service import announce
from qed_ray.service.lock import LockHeld
from qed_ray.service.ray_join import EXIT_NO_RAY, JoinFailed
from qed_ray.spec.sweep import SpecError, SweepSpec, load_spec

REPOSITORY = Path(__file__).resolve().parents[2]  # where sweeps/ and the README's relative paths are
EXAMPLES = ("qed-ray sweep sweeps/smoke.yaml --dry-run   # the plan and its cost; runs nothing",
            "qed-ray sweep sweeps/smoke.yaml             # run, resume or grow the sweep",
            "qed-ray sweep --status --dir results/smoke  # its progress, from any shell (no spec needed)")


def check_options(no_spec: bool, args) -> None:
    """Refuses flags that do not go together, naming them (SpecError)."""
    if (args.list or args.workers is not None or args.card or args.price_per_hour is not None) and not args.dry_run:
        raise SpecError("--list, --workers, --card, --price-per-hour: only with --dry-run")
    if args.price_per_hour is not None and not args.price_per_hour > 0:
        raise SpecError(f"--price-per-hour: {args.price_per_hour:g}; a node-hour's price in USD, more than 0")
    if args.workers is not None and args.workers < 1:
        raise SpecError(f"--workers: {args.workers} worker nodes; allowed 1 or more")
    if args.dir is not None and not args.status:
        raise SpecError("--dir: only with --status (a sweep's folder is its storage_path / QED_STORAGE_ROOT)")
    if args.force and not args.fresh:
        raise SpecError("--force: only with --fresh (it confirms moving aside a folder whose sweep.json cannot be "
                        "read)")
    if no_spec and not (args.status and args.dir is not None):
        raise SpecError("spec: required (a sweep YAML such as sweeps/smoke.yaml); only --status --dir DIR reads a "
                        "sweep without it")


def run_sweep(spec: SweepSpec, spec_path: Path, fresh: bool = False, gather_partial: bool = False,
              force: bool = False, allow_unverified: bool = False) -> int:
    """Runs (or resumes, or grows) the sweep end to end; returns the exit code. ``force``: ``fresh`` moves aside a
    folder whose ``sweep.json`` cannot be read. Everything refused before training is refused with the light modules
    alone, nothing is written before Ray is joined, and the driver (Ray Tune, MLflow, torch) is imported after."""
    from qed_ray.service.lock import SweepLock
    from qed_ray.service.ray_join import join_ray
    from qed_ray.service.results_key import load_key
    from qed_ray.records.sweep import sign_claim, write_state
    from qed_ray.service.sweep_state import check_folder, move_aside, plan, resolve_paths
    from qed_ray.service.mlflow.tracking_uri import unreachable, uri_field

    say = lambda line: print(line, flush=True)  # noqa: E731
    layout, uri, experiment = resolve_paths(spec)
    state = check_folder(layout, spec, fresh, force)
    from qed_ray.service.plan.machines import check_machine

    check_machine(spec)  # a pack this machine cannot place (an embedded cluster): refused before any folder exists
    if spec.pack.seeds == "auto":  # sized by the plan's memory model (torch): only for such a spec, before Ray
        from qed_ray.service.plan.dry_run import sized_spec

        spec = sized_spec(spec, state.pack_seeds if state is not None and not fresh else None)
    # Refused before anything is written (or moved aside), and checked again under the lock.
    _refuse(plan(None, spec).problems if fresh else plan(state, spec, layout).problems)
    problem = unreachable(uri)  # seconds now, not minutes of MLflow retries once Ray is up
    if problem:
        raise SpecError(f"{uri_field()}: {problem}; start the tracking server or correct the URI")
    key = load_key(create=True, sweep_dir=layout.root, log=say)
    SweepLock(layout.lock_file).refuse_if_held()  # at once, not after joining Ray
    join_ray()  # before anything is written to the folder: a join that gives up loses nothing
    from qed_ray.service import sweep as driver

    layout.root.mkdir(parents=True, exist_ok=True)
    with SweepLock(layout.lock_file, log=say) as lock:
        check_folder(layout, spec, fresh, force)
        if fresh and os.path.lexists(layout.state_file):
            say(f"--fresh: moved the previous sweep to {move_aside(layout)}")
        announced = False

        def start(this: SweepSpec) -> int:  # one start over the spec (an adaptive sweep: over one look's trials)
            nonlocal announced
            p = plan(check_folder(layout, this), this, layout)
            _refuse(p.problems)
            p.state = sign_claim(p.state, key.secret)  # the re-analysis checks the frozen claim by it
            write_state(layout, p.state)
            for line in [] if announced else announce.first_lines(spec.name, spec_path, layout, uri):
                say(line)
            announced = True
            return driver.run_locked(this, spec_path, layout, uri, experiment, p.state, p.new, gather_partial,
                                     p.packs, lock, key, allow_unverified)

        if spec.adaptive is None:
            code = start(spec)
        else:
            from qed_ray.service import looks

            code = looks.run_looks(spec, layout, start, lambda look: looks.log_look(uri, layout, look), say)
        if lock.lost.is_set() or not lock.beat():  # lost while (or after) training: nothing more of this start
            print(f"error: {lock.why}; this driver stopped its trials and leaves the sweep to the driver that holds "
                  f"it now", file=sys.stderr, flush=True)
            return driver.EXIT_LOST
        return code


def _refuse(problems: list[str]) -> None:
    if problems:
        raise SpecError("\n".join(problems))


def _load(path: Path) -> SweepSpec:
    if not path.exists():
        raise SpecError(missing_spec(path))
    return load_spec(path)


def missing_spec(path: Path, cwd: Path | None = None) -> str:
    """Why ``path`` (no file) is not a spec, and the spec that was probably meant: the closest name in its folder,
    or in the repository's when a relative path was given from another folder."""
    cwd = (cwd or Path.cwd()).resolve()
    elsewhere = not path.is_absolute() and cwd != REPOSITORY and (
        (REPOSITORY / path).is_file() or (not (cwd / path.parent).is_dir() and (REPOSITORY / path.parent).is_dir()))
    text = f"{path}: no such file"
    if elsewhere:
        text += f" in the current folder {cwd}; run from the repository root ({REPOSITORY}) or give an absolute path"
        if (REPOSITORY / path).is_file():
            return f"{text} ({REPOSITORY / path})"
    folder = (REPOSITORY if elsewhere else cwd) / path.parent
    specs = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml")) if folder.is_dir() else []
    if not specs:
        return text + ("" if folder.is_dir() else f" (no folder {path.parent} in {cwd})")
    names = {Path(name).stem: name for name in specs}
    stem = close_match(path.stem, names)  # by stem: ".yaml" alone would make every name close
    meant = f" (did you mean {str(path.parent / names[stem])!r}?)" if stem else ""
    return f"{text}{meant}; the specs in {path.parent}/: {', '.join(specs)}"


def parser():
    p = cli_help.parser("qed-ray sweep", __doc__, EXAMPLES, announce.local_head_help())
    p.add_argument("spec", type=Path, nargs="?", help="sweep YAML (see sweeps/ and docs/spec.md's field table); "
                   "not needed with --status --dir")
    p.add_argument("--dry-run", action="store_true", help="print the plan on this machine and each shipped cluster "
                   "(pack size, memory, hours, wall clock, price); run nothing (refuses what a run would refuse)")
    p.add_argument("--list", action="store_true", help="with --dry-run: every trial, pack by pack (longest first)")
    p.add_argument("--workers", type=int, metavar="N", help="with --dry-run: the bill on N worker nodes (default: "
                                                            "the shipped cluster configs' max_workers)")
    p.add_argument("--card", metavar="NAME", help="with --dry-run: the GPU of KubeRay's workers (a card of "
                                                  "cluster/prices.yaml; default: its qed-ray.io/card annotation)")
    p.add_argument("--price-per-hour", type=float, metavar="USD", help="with --dry-run: a worker node-hour's price "
                                                                       "(default: cluster/prices.yaml's)")
    p.add_argument("--fresh", action="store_true", help="start a new sweep (this sweep's folder is moved aside)")
    p.add_argument("--force", action="store_true", help="with --fresh: move the folder aside even when its "
                   "sweep.json cannot be read (then the folder cannot be checked to be this sweep's)")
    p.add_argument("--gather-partial", action="store_true", help="when stopped by Ctrl-C/SIGTERM, still gather the "
                                                                 "trials that finished")
    p.add_argument("--allow-unverified", action="store_true", help="exit 0 even when the gather step used seeds "
                   "unverified (their trials recorded no digest; default: exit 1)")
    p.add_argument("--status", action="store_true", help="print the sweep's progress and partial results from its "
                   "folder; starts nothing")
    p.add_argument("--dir", type=Path, help="with --status: the sweep folder to read (the driver prints it first; "
                   "default: the spec's storage_path, QED_STORAGE_PATH / QED_STORAGE_ROOT of this shell)")
    return p


def _status(spec: SweepSpec | None, folder: Path | None) -> str:
    from qed_ray.records.layout import SweepDir
    from qed_ray.service import status
    from qed_ray.service.sweep_state import resolve_paths

    columns = console.width()  # the partial table in blocks of columns, every line wrapped to fit
    if spec is None:  # --status --dir DIR: the spec sweep.json recorded
        layout = SweepDir(folder.absolute())
        return console.fit(status.report(status.recorded_spec(layout), layout, "given by --dir", columns), columns)
    layout = SweepDir(folder.absolute()) if folder else resolve_paths(spec)[0]
    if spec.search is not None:  # a k search's points so far are trials of its sweep
        from qed_ray.records.search import read_search
        from qed_ray.spec.search import grown

        spec = grown(spec, read_search(layout, spec).points)
    return console.fit(status.report(spec, layout, "given by --dir" if folder else announce.storage_source(spec),
                                     columns), columns)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("MUJOCO_GL", "disable")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0 the legacy reporter prints no tables
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # the driver's Interrupt handles SIGINT and SIGTERM alike
    try:
        spec = _load(args.spec) if args.spec is not None else None
        for line in spec.warnings() if spec is not None and not args.status else ():
            print(f"warning: {line}", file=sys.stderr, flush=True)
        check_options(spec is None, args)
        if spec is not None and spec.search is not None and not args.status:
            from qed_ray.spec.search import optuna_problem

            if optuna_problem():  # at once, before any folder, tracking server or Ray is touched
                raise SpecError(optuna_problem())
        if args.status:
            print(_status(spec, args.dir))
            return 0
        if args.dry_run:
            from qed_ray.service.plan.dry_run import dry_run

            return dry_run(spec, listing=args.list, workers=args.workers, fresh=args.fresh, force=args.force,
                           card=args.card, price_per_hour=args.price_per_hour)
        if spec.search is not None:
            from qed_ray.service.search import run_search

            return run_search(spec, args.spec.resolve(), run_sweep, args.fresh, args.gather_partial, args.force,
                              args.allow_unverified)
        return run_sweep(spec, args.spec.resolve(), args.fresh, args.gather_partial, args.force,
                         args.allow_unverified)
    except (SpecError, LockHeld, RecordError) as e:  # a damaged folder file (RecordError) names itself
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    except JoinFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NO_RAY
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
