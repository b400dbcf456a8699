"""Benchmark: the plan's memory formula (``qed_ray/service/plan/dry_plan.py``) against measured peaks.

On the CPU: the peak bytes of every tensor a pack creates (agent, replay at capacity, three updates), counted by a
dispatch mode (:class:`AllocationPeak`, the CPU's counterpart of ``torch.cuda.max_memory_allocated``), beside the
formula's tensors, for SAC-LN and MAD-SAC with te and QED at several widths, batches and pack sizes; exits 1 when
one is off by more than 20%. Then the GPU table's measured peaks (``qed_ray/data/throughput.json``, one process per
cell, replay of 10,000 rows per seed) beside the formula's allocator bytes: packs of 10 and more within 20%, packs
of one printed (over-counted: the fixed pools dominate).
Run: ``MUJOCO_GL=disable nice -n 10 .venv/bin/python benchmarks/bench_memory.py``.
"""

import sys
import weakref

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qed_ray.spec.config import RunSpec
from qed_ray.rl.agents import make_packed_agent
from qed_ray.rl.replay import Replay
from qed_ray.rl.update import PackUpdater
from qed_ray.service.plan.dry_plan import pack_memory
from qed_ray.records.throughput import load_throughput
from qed_ray.spec.tasks import TASK_DIMS

MAD_64 = {"latent_dim": 64, "encoder_hidden": 64, "model_hidden": 64, "num_bins": 51, "vmin": -50.0, "vmax": 50.0}


class AllocationPeak(TorchDispatchMode):
    """Bytes of the tensor storages created inside that are alive at once, at their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._seen:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


def runs(agent: str, kind: str, hidden: int, batch: int, members: int, capacity: int = 5000) -> list[RunSpec]:
    spec = {"name": agent, "hidden": hidden, "batch_size": batch, **({"mad": MAD_64} if agent == "mad_sac" else {})}
    temps = [{"kind": kind, **({"k": (0.1, 0.2, 0.4)[i % 3]} if kind == "qed" else {})} for i in range(members)]
    return [RunSpec.model_validate({"task": "cheetah-run", "seed": i, "agent": spec, "temperature": t,
                                    "train": {"replay_capacity": capacity}}) for i, t in enumerate(temps)]


def measured_peak(pack: list[RunSpec]) -> int:
    run, cpu = pack[0], torch.device("cpu")
    obs, act = TASK_DIMS[run.task]
    batch, capacity, on = run.agent.batch_size, run.train.replay_capacity, np.ones(len(pack), bool)
    with AllocationPeak() as peak:
        agent = make_packed_agent(run.agent, [r.temperature for r in pack], obs, act, cpu, [r.seed for r in pack])
        replay = Replay(capacity, obs, act, [np.random.default_rng(i) for i in range(len(pack))], cpu)
        replay.storage.normal_()
        replay.storage[..., replay.columns["terminated"]] = 0.0
        replay.added[:] = capacity
        update = PackUpdater(agent, replay, None, "off", batch)
        for _ in range(3):
            update(replay.indices(batch, on), agent.noise(batch, on))
    return peak.peak


def main() -> int:
    torch.set_num_threads(1)
    worst = gpu_worst = 0.0
    print("agent    temp width batch  S | measured MiB | formula MiB | formula/measured")
    for agent in ("sac_ln", "mad_sac"):
        for kind in ("te", "qed"):
            for hidden, batch, members in ((64, 64, 1), (128, 256, 3), (256, 128, 2), (256, 256, 1)):
                pack = runs(agent, kind, hidden, batch, members)
                got, est = measured_peak(pack), pack_memory(pack, 0, 0.0, 0).tensors
                worst = max(worst, abs(est / got - 1))
                print(f"{agent:8s} {kind:4s} {hidden:5d} {batch:5d} {members:2d} | {got / 2**20:12.1f} | "
                      f"{est / 2**20:11.1f} | {est / got:.3f}", flush=True)
    print(f"worst: {worst:.1%} off (limit 20%)")
    table = load_throughput()
    if table is not None:  # the GPU table's cells: one process each, the replay of gpu_bench.py (10,000 rows)
        print(f"GPU table ({table.card}): measured peak MiB | formula MiB | formula/measured")
        for e in table.entries:
            if e.packs == 1 and e.peak_mib and e.mode == "graph" and e.precision == "fp32":
                spec = {"name": e.agent, "hidden": table.hidden, "batch_size": table.batch}
                pack = [RunSpec.model_validate({"task": "cheetah-run", "seed": i, "agent": spec, "temperature": {
                    "kind": e.temperature, **({"k": 0.2} if e.temperature == "qed" else {})},
                    "train": {"replay_capacity": 10_000}}) for i in range(e.seeds)]
                est = pack_memory(pack, 0, 1.0, 80 * 2**30).tensors / 2**20
                if e.seeds >= 10:  # a pack of one: the pools' fixed part dominates (the formula over-counts)
                    gpu_worst = max(gpu_worst, abs(est / e.peak_mib - 1))
                print(f"  {e.agent:8s} {e.temperature:4s} S={e.seeds:2d}: {e.peak_mib:8.0f} | {est:8.0f} | "
                      f"{est / e.peak_mib:.3f}")
        print(f"GPU worst (packs of 10 and more): {gpu_worst:.1%} off (limit 20%)")
    return 1 if max(worst, gpu_worst) > 0.2 else 0


if __name__ == "__main__":
    sys.exit(main())
