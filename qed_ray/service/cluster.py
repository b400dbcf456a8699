"""The driver's cluster-aware refusals, before any trial starts (:func:`check_cluster`): a trial no node can hold,
a storage folder or SQLite store that not every node can reach.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import ray

from qed_ray.service.sweep_state import sqlite_on_many_machines
from qed_ray.spec.sweep import SpecError, SweepSpec


def check_cluster(spec: SweepSpec, sweep_dir: Path, uri: str) -> None:
    """Refusals that save a multi-node sweep from failing late: some node must hold one trial (else Tune would pend
    forever, ray#19985); every node must see the storage folder and a SQLite store (a marker looked for by a task
    pinned to each node); SQLite over several machines is refused (its locking is not reliable over NFS)."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    need = {"CPU": spec.trial_resources()["cpu"], "GPU": spec.trial_resources()["gpu"]}
    if not any(all(n["Resources"].get(k, 0) >= v for k, v in need.items() if v > 0) for n in nodes):
        have = sorted({f"CPU={n['Resources'].get('CPU', 0):g}, GPU={n['Resources'].get('GPU', 0):g}"
                       for n in nodes})
        raise SpecError(f"resources: a trial asks for CPU={need['CPU']:g}, GPU={need['GPU']:g} but no node has "
                        f"that much (nodes: {'; '.join(have)})")
    if len(nodes) < 2:
        return
    problem = sqlite_on_many_machines(uri, nodes)
    if problem:
        raise SpecError(problem)
    checks = [("storage_path", sweep_dir)]
    if uri.startswith("sqlite:"):
        checks.append(("tracking.uri", Path(uri.removeprefix("sqlite:///")).parent))
    for field, folder in checks:
        folder.mkdir(parents=True, exist_ok=True)
        marker = folder / f".qed-reach-{uuid.uuid4().hex[:8]}"
        marker.write_text("x")
        try:
            blind = [n["NodeID"][:8] for n in nodes if not ray.get(_exists_on.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    n["NodeID"], soft=False)).remote(str(marker)))]
        finally:
            marker.unlink(missing_ok=True)
        if blind:
            raise SpecError(f"{field}: {folder} is local to the driver's node; nodes {', '.join(blind)} cannot "
                            f"reach it. Use a shared filesystem mounted at the same path on every node or, for "
                            f"MLflow, a tracking server (MLFLOW_TRACKING_URI=http://head:5000)")


@ray.remote(num_cpus=0)
def _exists_on(path: str) -> bool:
    return os.path.exists(path)
