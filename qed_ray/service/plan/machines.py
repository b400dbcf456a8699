"""The machines a plan is made for: this one and every shipped cluster of ``cluster/`` (``prices.yaml``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import Field

from qed_ray.records.codec import Record, parse
from qed_ray.service.ray_join import target
from qed_ray.spec.replay_memory import GIB
from qed_ray.spec.sweep import SpecError, SweepSpec

CLUSTER_DIR = Path(__file__).parents[3] / "cluster"
CARD_ANNOTATION = "qed-ray.io/card"
NVIDIA_GPUS = "/proc/driver/nvidia/gpus"  # one folder per GPU the NVIDIA driver sees


class NodePrice(Record):
    card: str
    gpu_gib: float = Field(gt=0)
    host_gib: float = Field(gt=0)
    cpus: int = Field(ge=1)
    gpus: int = Field(ge=0)
    on_demand: float = Field(gt=0)
    spot: float = Field(gt=0)


class ClusterPrice(Record):
    config: str
    worker: str | None
    fixed_per_hour: float = Field(ge=0)
    fixed: str


class PriceTable(Record):
    """``cluster/prices.yaml``: the date and sources of its prices, cards' FP32 peaks, node types, clusters."""

    date: str
    sources: dict[str, str]
    cards: dict[str, float]
    nodes: dict[str, NodePrice]
    clusters: dict[str, ClusterPrice]


@dataclass(frozen=True)
class Machine:
    """``nodes`` worker nodes of ``node`` (``card`` None: CPUs only): what one offers packs and costs an hour."""

    name: str
    node: str
    card: str | None
    gpu_bytes: int
    host_bytes: int
    cpus: int
    gpus: int
    nodes: int
    on_demand: float | None = None
    spot: float | None = None
    fixed_per_hour: float = 0.0
    fixed: str = ""


def this_machine(cpus: int | None = None, host_bytes: int | None = None, gpus: int | None = None) -> Machine:
    """This machine (``os.cpu_count()``, its RAM, its CUDA devices; each injectable)."""
    card, gpu_bytes = None, 0
    if gpus is None:  # the driver's count, read without importing torch; their card and memory from torch
        gpus = len(os.listdir(NVIDIA_GPUS)) if os.path.isdir(NVIDIA_GPUS) else 0
        if gpus:
            import torch

            card, gpu_bytes = torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory
    host = host_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Machine("this machine", "this machine", card, gpu_bytes, host, cpus or os.cpu_count() or 1, gpus, 1)


def per_node(spec: SweepSpec, m: Machine) -> int:
    """Packs a node of ``m`` runs at once: by its CPUs and, for GPU packs, its GPU shares."""
    by_cpu = int(m.cpus // spec.trial_resources()["cpu"])
    return min(by_cpu, round(m.gpus / spec.resources.gpu)) if spec.resources.gpu else by_cpu


def placement_problem(spec: SweepSpec, m: Machine) -> str | None:
    """Why no pack of ``spec`` can be placed on ``m`` at any size (the field, the reason and the fix), or None."""
    gpu, cpu = spec.resources.gpu, spec.trial_resources()["cpu"]
    if gpu and not m.gpus:
        return (f"resources.gpu: a pack asks for {gpu:g} GPU and {m.name} has none; set resources.gpu: 0 to train "
                f"on CPUs, or run on a GPU cluster")
    if cpu > m.cpus:
        return (f"resources.cpu: a pack asks for {cpu:g} CPUs (resources.cpu + pack.env_workers) and {m.node} has "
                f"{m.cpus}; ask for at most {m.cpus}")
    return None


def check_machine(spec: SweepSpec, here: Machine | None = None) -> None:
    """Refuses (SpecError naming the field, with the fix) a pack this machine cannot place, where a start runs on it."""
    if target().address is None and (problem := placement_problem(spec, here or this_machine())):
        raise SpecError(problem)


def load_prices(folder: Path = CLUSTER_DIR) -> PriceTable | None:
    """``prices.yaml`` of ``folder`` (None: no ``cluster/``); a malformed table raises SpecError naming the field."""
    path = folder / "prices.yaml"
    return parse(PriceTable, yaml.safe_load(path.read_text()), path, SpecError) if path.is_file() else None


def clusters(prices: PriceTable, folder: Path = CLUSTER_DIR, card: str | None = None) -> list[Machine]:
    """Every cluster of ``prices`` (KubeRay's card: ``card``, else its annotation)."""
    out = []
    for name, c in prices.clusters.items():
        docs = list(yaml.safe_load_all((folder.parent / c.config).read_text()))
        if c.worker is None:
            out.append(_kuberay(name, c, docs, prices, card))
            continue
        n = prices.nodes[c.worker]
        out.append(Machine(name, c.worker, n.card, int(n.gpu_gib * GIB), int(n.host_gib * GIB), n.cpus, n.gpus,
                           int(docs[0]["max_workers"]), n.on_demand, n.spot, c.fixed_per_hour, c.fixed))
    return out


def _kuberay(name: str, c: ClusterPrice, docs: list, prices: PriceTable, card: str | None) -> Machine:
    """A pod of its RayCluster's worker group (its limits less its /dev/shm), priced as the node type with its card."""
    group = next(d for d in docs if d and d.get("kind") == "RayCluster")["spec"]["workerGroupSpecs"][0]
    pod = group["template"]
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    shm = sum(_bytes(v["emptyDir"].get("sizeLimit", "0")) for v in pod["spec"].get("volumes", [])
              if v.get("emptyDir", {}).get("medium") == "Memory")
    card = card or pod.get("metadata", {}).get("annotations", {}).get(CARD_ANNOTATION)
    if card not in prices.cards:
        raise SpecError(f"--card: {card!r} is not a card of cluster/prices.yaml ({', '.join(prices.cards)}); "
                        f"name KubeRay's GPU with --card or the {CARD_ANNOTATION} annotation of {c.config}")
    like = next((n for n in prices.nodes.values() if n.card == card), None)
    return Machine(name, f"a {limits['cpu']}-CPU pod", card, int((like.gpu_gib if like else 80) * GIB),
                   _bytes(limits["memory"]) - shm, int(float(limits["cpu"])), int(limits["nvidia.com/gpu"]),
                   int(group["maxReplicas"]), like and like.on_demand, like and like.spot, c.fixed_per_hour, c.fixed)


def _bytes(quantity: str) -> int:
    """Bytes of a Kubernetes quantity (``56Gi``, ``500M``)."""
    number, unit = re.fullmatch(r"([\d.]+)([A-Za-z]*)", str(quantity)).groups()
    scale = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    return int(float(number) * scale[unit])
