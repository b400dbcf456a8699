"""The live gather step: one named actor per driver start drives the gather engine as a sweep's trials end, each
group evaluated as a Ray task beside training (docs/design.md: data flow, the gather row). A group gathered while
MLflow did not answer is gathered again at the end."""

from __future__ import annotations

import asyncio
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import ray
from ray import tune
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from qed_ray.analysis import group_cache
from qed_ray.analysis.checksums import Verifier
from qed_ray.analysis.gather_engine import GatherEngine
from qed_ray.records.layout import SweepDir
from qed_ray.analysis.results import FailedTrial, GroupKey, GroupResult, SweepResults
from qed_ray.spec.sweep import FinalEvalSpec, SweepSpec
from qed_ray.analysis.group_view import GroupView, baseline_in, group_view
from qed_ray.service.mlflow.mirror import log_files, log_groups, log_rows
from qed_ray.service.mlflow.tracking import Tracker
from qed_ray.records.run import diverged_reason
from qed_ray.service.packing import TuneTrial

NAMESPACE = "qed_ray"


def actor_name(sweep_name: str, sweep_id: str) -> str:
    return f"qed-gather-{sweep_name}-{sweep_id}"


@dataclass(frozen=True)
class GatherReport:
    """What a driver start's gather step did; ``delays_s``: per group the seconds from its last trial's end to its
    row in MLflow (groups whose last trial ended while this driver ran)."""

    results: SweepResults
    evaluated: list[str]
    from_cache: list[str]
    delays_s: dict[str, float]
    lines: list[str] = field(default_factory=list)  # one per group as it landed (GatherFeed printed the first ones)


@dataclass(frozen=True)
class GatherPlan:
    """What the gather actor of one sweep needs; ``parent_run_id`` None: log nothing to MLflow."""

    sweep: str
    sweep_id: str
    sweep_dir: str
    final_eval: FinalEvalSpec
    groups: dict[GroupKey, list[str]]
    tracking_uri: str
    experiment: str
    parent_run_id: str | None
    group_resources: dict
    max_in_flight: int
    claim: dict | None = None  # sweep.json's pre-registration record (qed_ray.spec.claim), for the verdict
    results_key: bytes = field(default=b"", repr=False)  # the user's results key (qed_ray.service.results_key)
    judge: bool = True  # False: no verdict (a k search is exploratory)


def group_task_resources(nodes: list[dict], trial_cpu: float, trial_gpu: float, n_trials: int,
                         max_concurrent: int | None) -> tuple[dict, int]:
    """Ray resources of one group evaluation and how many may run at once, without starving training: 1 CPU each
    where the cluster has CPUs trials can never use (as many at once as there are), else no CPU and one at a time on
    a single thread (a 1-CPU task would wait for the last trial)."""
    fits = 0
    for node in nodes:
        res = node.get("Resources", {})
        by_cpu = math.floor(res.get("CPU", 0) / trial_cpu + 1e-9)
        by_gpu = math.floor(res.get("GPU", 0) / trial_gpu + 1e-9) if trial_gpu > 0 else by_cpu
        fits += min(by_cpu, by_gpu)
    concurrent = min(fits, n_trials, max_concurrent or n_trials)
    spare = sum(n.get("Resources", {}).get("CPU", 0) for n in nodes) - concurrent * trial_cpu
    if spare >= 1:
        return {"num_cpus": 1}, int(spare)
    return {"num_cpus": 0}, 1


@ray.remote
def _evaluate_group_task(job: group_cache.GroupJob, final_eval: FinalEvalSpec) -> GroupResult:
    import torch

    torch.set_num_threads(1)
    return group_cache.evaluate(job, final_eval, device="cuda" if torch.cuda.is_available() else "cpu")


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]


@ray.remote(num_cpus=0)
class Gatherer:
    """Gathers one sweep's groups as their trials finish: ``max_in_flight`` groups at once, each evaluation a Ray
    task; file and MLflow work runs on one thread, in order."""

    def __init__(self, plan: GatherPlan):
        self.plan, self.layout = plan, SweepDir(plan.sweep_dir)
        self.engine = GatherEngine(self.layout, plan.final_eval, plan.results_key)
        self.group_of = {n: k for k, names in plan.groups.items() for n in names}
        self.finished: set[str] = set()
        self.failed: dict[str, str] = {}
        self.jobs: dict[GroupKey, asyncio.Task] = {}
        self.seen_at: dict[str, float] = {}
        self.logged_at: dict[GroupKey, float] = {}
        self.io = ThreadPoolExecutor(1)
        self.groups = ThreadPoolExecutor(plan.max_in_flight)
        self.dirty = False
        self.refresher: asyncio.Task | None = None
        self.tracker: Tracker | None = None
        self.retry: set[GroupKey] = set()  # groups to gather again at the end (MLflow did not answer)
        self.mlflow_down = False
        self.written: str | None = None  # the results.json text of the last files written (_refresh)
        self.files_logged = False  # and whether they reached the parent run
        self.viewed: dict[GroupKey, bool] = {}  # groups announced, and whether with their ratios to te
        self.unlogged: dict[GroupKey, GroupView] = {}  # views not yet in their group runs (MLflow did not answer)
        self.lines: list[str] = []  # one per group as it lands (and once more when its te lands): the console's

    async def trial_finished(self, name: str, live: bool = True) -> None:
        """A trial ended; the folder says how (idempotent): neither done nor diverged (stopped with the sweep) is
        nothing. ``live``: it ended now, not before this start."""
        if name not in self.group_of or name in self.finished:
            return
        state = self.layout.trial_state(name)
        if state == "diverged":
            await self.trial_failed(name, diverged_reason(self.layout, name), live)
        elif state == "done":
            self.finished.add(name)
            self.failed.pop(name, None)
            if live:
                self.seen_at[name] = time.time()
            self._start_if_complete(self.group_of[name])

    async def trial_failed(self, name: str, error: str, live: bool = True) -> None:
        if name in self.group_of and name not in self.finished:
            self.failed[name] = error
            if live:
                self.seen_at[name] = time.time()
            self._start_if_complete(self.group_of[name])

    def _start_if_complete(self, key: GroupKey) -> None:
        names = self.plan.groups[key]
        if key not in self.jobs and all(n in self.finished or n in self.failed for n in names):
            self.jobs[key] = asyncio.get_running_loop().create_task(self._gather(key))

    async def _blocking(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    async def _gather(self, key: GroupKey) -> None:
        names = self.plan.groups[key]
        self.engine.exclude(FailedTrial(n, self.failed[n]) for n in names if n in self.failed)
        finished = [n for n in names if n in self.finished]
        try:
            recorded = await self._blocking(lambda: self._tracker().recorded_digests())
        except Exception as e:  # noqa: BLE001 - MLflow unreachable: the snapshots cannot be checked now
            self.retry.add(key)
            self.engine.exclude(FailedTrial(n, f"gather refused {key.name}: {_cause(e)}") for n in finished)
        else:
            verifier = Verifier(self.plan.sweep_id, self.plan.results_key, recorded)
            await asyncio.get_running_loop().run_in_executor(self.groups, self.engine.group, key, finished, verifier,
                                                             self._evaluate)
        self.dirty = True
        if self.refresher is None or self.refresher.done():
            self.refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    def _evaluate(self, job: group_cache.GroupJob) -> GroupResult:
        return ray.get(_evaluate_group_task.options(**self.plan.group_resources).remote(job, self.plan.final_eval))

    def _tracker(self) -> Tracker:
        if self.tracker is None:
            p = self.plan
            self.tracker = Tracker(p.tracking_uri, p.experiment, p.sweep_id)
        return self.tracker

    async def _refresh_loop(self) -> None:
        while self.dirty:  # groups landing during a refresh are covered by the next one, not one each
            self.dirty = False
            await self._blocking(self._refresh)

    def _refresh(self) -> SweepResults:
        results = self.engine.sweep_results(self.plan.sweep, len(self.group_of), self.plan.claim, self.plan.judge)
        new = [g for g in results.groups if g.key not in self.logged_at]
        self.unlogged.update({v.key: v for v in self._views(results)})
        # The rows first (figures take seconds to draw); MLflow is a mirror: gather/ is written either way.
        if self._mirror(log_rows, results, new):
            now = time.time()
            self.logged_at.update({g.key: now for g in new})
        if self.unlogged and self._mirror(log_groups, list(self.unlogged.values()), True):
            self.unlogged = {}
        # Results unchanged since the last refresh (the sweep's end after its last group landed) keep their files and
        # their upload: the figures alone take seconds to draw.
        text = json.dumps(results.to_json(), sort_keys=True)
        if text != self.written:
            self.engine.write(results)
            self.written, self.files_logged = text, False
        if not self.files_logged:
            self.files_logged = self._mirror(log_files, self.layout)
        return results

    def _views(self, results: SweepResults) -> list[GroupView]:
        """The views of the groups that landed since the last refresh, and of those whose te baseline did."""
        out, fe = [], self.plan.final_eval
        for g in results.groups:
            had = self.viewed.get(g.key)
            if had or (had is False and not baseline_in(g, results.groups)):
                continue
            view = group_view(g, results.groups, fe)
            if had is None or view.ratios is not None:
                self.viewed[g.key] = view.ratios is not None
                self.lines.append(view.line(fe.confidence, "gathered" if had is None else "its te is in:"))
                out.append(view)
        return out

    async def new_lines(self, after: int) -> list[str]:
        return self.lines[after:]

    def _mirror(self, log, *args) -> bool:
        """One best-effort logging call to the parent run (one warning per outage); False if it failed."""
        if self.plan.parent_run_id is None:
            return False
        try:
            log(self._tracker(), self.plan.parent_run_id, *args)
        except Exception as e:  # noqa: BLE001 - any failure of the tracking store; the next refresh tries again
            if not self.mlflow_down:
                print(f"WARNING: gather: MLflow failed ({_cause(e)}); the results are in {self.layout.gather} and "
                      f"are logged when it answers again", flush=True)
            self.mlflow_down = True
            return False
        self.mlflow_down = False
        return True

    def _again(self, key: GroupKey) -> None:
        self.retry.discard(key)
        self.engine.forget(key, [n for n in self.plan.groups[key] if n in self.finished])
        self.logged_at.pop(key, None)
        del self.jobs[key]
        self._start_if_complete(key)

    async def finish(self, failed: list[FailedTrial]) -> GatherReport:
        """The sweep ended: the given failures are final, unfinished trials are left out, every group is gathered."""
        for f in failed:  # the driver's reasons are the final ones (the callback only knew that Tune gave up)
            if f.name in self.group_of and f.name not in self.finished:
                self.failed[f.name] = f.error
                if f.name in self.engine.excluded:
                    self.engine.exclude([f])
        for name in self.group_of:
            if name not in self.finished and name not in self.failed:
                self.failed[name] = "did not finish"
        for key in self.plan.groups:
            self._start_if_complete(key)
        await asyncio.gather(*self.jobs.values())
        for key in sorted(self.retry):  # once more: MLflow may answer now
            self._again(key)
        await asyncio.gather(*self.jobs.values())
        if self.refresher is not None:
            await self.refresher
        self.engine.exclude(f for f in failed if f.name not in self.group_of)  # e.g. a failure of the gather step
        results = await self._blocking(self._refresh)
        delays = {k.name: self.logged_at[k] - max(self.seen_at[n] for n in self.plan.groups[k] if n in self.seen_at)
                  for k in self.engine.results if k in self.logged_at
                  and any(n in self.seen_at for n in self.plan.groups[k])}
        return GatherReport(results, self.engine.evaluated, self.engine.from_cache, delays, list(self.lines))


class GatherFeed(tune.Callback):
    """Tells the gather actor, looked up by name at each call, about every trial that ends or fails for good."""

    def __init__(self, name: str, every_s: float = 5.0):
        self.name, self.every_s = name, every_s
        self.printed, self.last = 0, 0.0  # the gather actor's console lines printed so far, and when it was asked
        # (lines printed when asked, the answer on its way): never waited for, Tune's loop must not block on the actor
        self.asked = None

    def _actor(self):
        return ray.get_actor(self.name, namespace=NAMESPACE)

    def on_step_end(self, iteration: int, trials: list, **info) -> None:
        try:
            if self.asked is not None and ray.wait([self.asked[1]], timeout=0)[0]:
                (after, ref), self.asked = self.asked, None
                self.print_lines(ray.get(ref)[self.printed - after:])
            if self.asked is None and time.time() - self.last >= self.every_s:
                self.last = time.time()
                self.asked = (self.printed, self._actor().new_lines.remote(self.printed))
        except (ValueError, ray.exceptions.RayError):  # the actor is gone: the closing summary prints the lines
            self.asked = None

    def print_lines(self, lines: list[str]) -> None:
        """One line per group whatever its width (one line to grep)."""
        for line in lines:
            print(line, flush=True)
        self.printed += len(lines)

    def _tell(self, method: str, *args) -> None:
        try:
            getattr(self._actor(), method).remote(*args)
        except ValueError as e:  # the actor is gone: training goes on; the end of the sweep reports it
            print(f"  gather: cannot reach the gather actor ({e}); results come at the next start", flush=True)

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        for name in TuneTrial.of(trial.config).names:  # a pack's seed runs, each as the folder shows it
            self._tell("trial_finished", name)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        for name in TuneTrial.of(trial.config).names:
            self._tell("trial_finished", name)  # a seed run that ended before its pack failed is no failure
            self._tell("trial_failed", name, "failed (see its error.txt)")


def launch(spec: SweepSpec, layout: SweepDir, sweep_id: str, uri: str, experiment: str, parent_run_id: str,
           results_key: bytes, n_tune_trials: int | None = None, claim: dict | None = None):
    """Starts this driver start's gather actor, handing it the trials the folder shows ended."""
    names = [t.name for t in spec.trials()]
    need = spec.trial_resources()
    resources, in_flight = group_task_resources(
        [n for n in ray.nodes() if n.get("Alive")], need["cpu"], need["gpu"], n_tune_trials or len(names),
        spec.max_concurrent_trials)
    plan = GatherPlan(spec.name, sweep_id, str(layout.root), spec.final_eval, group_cache.plan_groups(names), uri,
                      experiment, parent_run_id, resources, in_flight, claim, results_key, spec.search is None)
    return start(plan, [n for n in names if layout.trial_state(n) != "pending"])


def start(plan: GatherPlan, done: list[str]):
    """Starts the gather actor and hands it the trials already done or diverged (their groups start at once)."""
    # On the driver's node: it lives and dies with the driver, never with a worker node the autoscaler removes.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = Gatherer.options(name=actor_name(plan.sweep, plan.sweep_id), namespace=NAMESPACE,
                             scheduling_strategy=here).remote(plan)
    ray.get([actor.trial_finished.remote(n, False) for n in done])
    return actor


def finish(actor, failed: list[FailedTrial]) -> GatherReport:
    try:
        return ray.get(actor.finish.remote(failed))
    finally:
        ray.kill(actor)


def stop(actor) -> None:
    """Stops the actor without a final gather (gathered groups stay cached; evaluations in flight are redone)."""
    ray.kill(actor)
