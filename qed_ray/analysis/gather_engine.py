"""The gather engine: a sweep's groups from their finished trials to results, tables and output files."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from qed_ray.analysis import group_cache, outputs, tables
from qed_ray.analysis.checksums import Verifier
from qed_ray.analysis.group_cache import GroupJob
from qed_ray.analysis.results import FailedTrial, GroupKey, GroupResult, SweepResults
from qed_ray.records.layout import SweepDir
from qed_ray.spec.sweep import FinalEvalSpec

Evaluate = Callable[[GroupJob], GroupResult]  # a prepared group's evaluation (group_cache.evaluate, wherever it runs)


def _quiet(line: str) -> None:
    pass


class GatherEngine:
    """The groups gathered so far and the trials left out, with their reasons.

    Args:
        layout: the sweep folder.
        final_eval: the final-evaluation settings.
        signing_key: signs and checks the cache (None: the verifier's key, and without a verifier the cache is left
            alone).
        log: where a damaged cache entry or a refused group is named.
        progress: where each group's way is told (``<group>: cached``, ``evaluated (s)``); default: nowhere.
    """

    def __init__(self, layout: SweepDir, final_eval: FinalEvalSpec, signing_key: bytes | None = None,
                 log: Callable[[str], Any] = print, progress: Callable[[str], Any] = _quiet):
        self.layout, self.final_eval, self.signing_key = layout, final_eval, signing_key
        self.log, self.progress = log, progress
        self.results: dict[GroupKey, GroupResult] = {}
        self.excluded: dict[str, FailedTrial] = {}
        self.evaluated: list[str] = []
        self.from_cache: list[str] = []
        self.refused: list[str] = []  # one line per refused group: its name, the error's type and message
        self._lock = threading.Lock()  # groups may be gathered on several threads at once

    def exclude(self, failed: Iterable[FailedTrial]) -> None:
        """Leaves these trials out, each with its reason (a later reason for the same trial replaces the earlier)."""
        with self._lock:
            self.excluded.update({f.name: f for f in failed})

    def group(self, key: GroupKey, finished: list[str], verifier: Verifier | None,
              evaluate: Evaluate | None = None) -> GroupResult | None:
        """Gathers one group from its ``finished`` trials: prepared (a seed that cannot be read is left out, with the
        reason), taken from the cache when its seeds and the entry pass their checks, else evaluated by ``evaluate``
        (default: here) and stored. A group that is refused (a seed's file differs from its signed digest, an
        unreadable seed, an edited cache entry, an evaluation that failed) leaves its seeds out naming why; returns
        its result, or None."""
        job = group_cache.prepare(self.layout, key, finished, verifier, self.final_eval, self.signing_key)
        self.exclude(job.excluded)
        try:
            result = group_cache.cached(job, self.log)
            if result is None and job.records:
                t0 = time.perf_counter()
                result = evaluate(job) if evaluate else group_cache.evaluate(job, self.final_eval)
                if job.signing_key is not None:
                    group_cache.store(self.layout, job.key, result, job.signing_key, self.log)
                self._landed(key, result, self.evaluated, f"evaluated ({time.perf_counter() - t0:.1f} s)")
            elif result is not None:
                self._landed(key, result, self.from_cache, "cached")
        except Exception as e:  # noqa: BLE001 - a refused group is reported, the others still land
            cause = getattr(e, "cause", None) or e  # a Ray task's error carries the original exception as .cause
            with self._lock:
                self.refused.append(f"{key.name}: {type(cause).__name__}: {cause}")
            self.exclude(FailedTrial(r.name, f"gather refused {key.name}: {cause}") for r in job.records)
            self.log(f"  {key.name}: REFUSED: {cause}")
            return None
        return result

    def _landed(self, key: GroupKey, result: GroupResult, how: list[str], line: str) -> None:
        with self._lock:
            self.results[key] = result
            how.append(key.name)
        self.progress(f"  {key.name}: {line}")

    def forget(self, key: GroupKey, names: Iterable[str]) -> None:
        """Forgets a gathered group's outcome (its trials ``names`` no longer left out), to gather it again."""
        with self._lock:
            for n in names:
                self.excluded.pop(n, None)
            self.results.pop(key, None)
            for done in (self.evaluated, self.from_cache):
                if key.name in done:
                    done.remove(key.name)

    def sweep_results(self, sweep: str, n_trials: int, claim: dict | None = None, judge: bool = True) -> SweepResults:
        """Every table of the sweep from the groups gathered so far (:func:`qed_ray.analysis.tables.sweep_results`;
        ``judge`` False for a k search), the trials left out sorted by name."""
        with self._lock:
            groups, failed = list(self.results.values()), sorted(self.excluded.values(), key=lambda f: f.name)
        return tables.sweep_results(sweep, self.final_eval, groups, failed, n_trials, claim, judge)

    def write(self, results: SweepResults, folder: Path | None = None) -> None:
        """The output files of ``results`` into ``folder`` (default ``gather/``; :mod:`qed_ray.analysis.outputs`)."""
        outputs.write_results(results, self.layout, folder)
