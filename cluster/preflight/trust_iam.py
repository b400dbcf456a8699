"""The head's cloud rights reach this cluster's instances only (cluster/iam/, the GCP binding in cluster/README.md).

The head runs the job driver and every submitted job, so whatever its cloud identity may do, any job may do. AWS: the
autoscaler launches instances only with the cluster's tag and of the config's worker types, tags only at launch or
on instances that already carry the cluster's tag (never changing that tag), and terminates only those. GCP: the
head's project-level role binding carries an IAM condition limiting instance and disk permissions to the names Ray
gives this cluster's VMs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

CLUSTER_TAG = "ray-cluster-name"  # the tag (AWS) / name prefix (GCP) Ray gives every node of a cluster
INSTANCE_RESOURCE = re.compile(r"^arn:aws:ec2:[^:]*:[^:]*:instance/")


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def _allows(policy: dict, action: str) -> list[tuple[list[str], dict]]:
    """(resources, condition) of each Allow statement of ``action``."""
    return [(_listed(s.get("Resource", [])), s.get("Condition") or {}) for s in _listed(policy.get("Statement", []))
            if s.get("Effect") == "Allow" and action in _listed(s.get("Action", []))]


def _equals(condition: dict, key: str) -> set[str] | None:
    """The values a StringEquals condition requires of ``key`` (None if it does not constrain it)."""
    block = condition.get("StringEquals") or {}
    return {str(v) for v in _listed(block[key])} if key in block else None


def _run_problems(role: str, policy: dict, cluster: str, instance_types: set[str]) -> list[str]:
    problems = []
    for resources, condition in _allows(policy, "ec2:RunInstances"):
        if "*" in resources:
            problems.append(f"{role}: ec2:RunInstances on '*'; allow it on the instance resource "
                            f"(arn:aws:ec2:<region>:<account>:instance/*) under the cluster's tag, and on the images, "
                            f"subnets, security groups, interfaces, volumes separately")
        if not any(INSTANCE_RESOURCE.match(r) for r in resources):
            continue
        if _equals(condition, f"aws:RequestTag/{CLUSTER_TAG}") != {cluster}:
            problems.append(f"{role}: ec2:RunInstances must require the tag {CLUSTER_TAG}={cluster} on what it "
                            f"launches (StringEquals aws:RequestTag/{CLUSTER_TAG})")
        types = _equals(condition, "ec2:InstanceType")
        if types is None:
            problems.append(f"{role}: ec2:RunInstances may launch any instance type; limit ec2:InstanceType to the "
                            f"workers' {sorted(instance_types)}")
        elif not instance_types <= types:
            problems.append(f"{role}: ec2:InstanceType {sorted(types)} lacks the workers' "
                            f"{sorted(instance_types - types)}: the autoscaler could not launch them")
    return problems


def _tag_problems(role: str, policy: dict, cluster: str) -> list[str]:
    problems = []
    for _, condition in _allows(policy, "ec2:CreateTags"):
        at_launch = _equals(condition, "ec2:CreateAction") == {"RunInstances"}
        keeps_key = CLUSTER_TAG in _listed(
            (condition.get("ForAllValues:StringNotEquals") or {}).get("aws:TagKeys", []))
        own = _equals(condition, f"ec2:ResourceTag/{CLUSTER_TAG}") == {cluster} and keeps_key
        if not (at_launch or own):
            problems.append(f"{role}: ec2:CreateTags only at launch (ec2:CreateAction RunInstances) or on instances "
                            f"tagged {CLUSTER_TAG}={cluster} without touching that key (ForAllValues:StringNotEquals "
                            f"aws:TagKeys): otherwise the head can tag any instance as this cluster's and terminate it")
    for _, condition in _allows(policy, "ec2:TerminateInstances"):
        if _equals(condition, f"ec2:ResourceTag/{CLUSTER_TAG}") != {cluster}:
            problems.append(f"{role}: ec2:TerminateInstances must be limited to this cluster's instances "
                            f"(StringEquals ec2:ResourceTag/{CLUSTER_TAG}: {cluster})")
    return problems


def aws_head_scope_problems(role: str, policy: dict, cluster: str, instance_types: set[str]) -> list[str]:
    """The head's EC2 rights reach this cluster's instances only (see the module docstring)."""
    return _run_problems(role, policy, cluster, instance_types) + _tag_problems(role, policy, cluster)


def _binding_commands(readme: str, account: str) -> list[dict[str, str]]:
    """The ``--flag=value`` options of each ``gcloud projects add-iam-policy-binding`` of ``account`` in the README."""
    joined = readme.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        if "gcloud projects add-iam-policy-binding" in line and f"serviceAccount:{account}@" in line:
            words = shlex.split(line.split("#", 1)[0])
            found.append(dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w))
    return found


def _condition_problems(expression: str, project: str, zones: list[str], cluster: str) -> list[str]:
    prefixes = set(re.findall(r'resource\.name\.startsWith\("([^"]*)"\)', expression))
    wanted = {f"projects/{project}/zones/{z}/{kind}/ray-{cluster}-" for z in zones for kind in ("instances", "disks")}
    problems = []
    if not {p for p in wanted if "/instances/" in p} <= prefixes:
        problems.append(f"the condition must limit instances to the names Ray gives this cluster: "
                        f"resource.name.startsWith(\"projects/{project}/zones/<zone>/instances/ray-{cluster}-\") "
                        f"for the zones {zones}")
    if prefixes - wanted:
        problems.append(f"the condition admits other names: {sorted(prefixes - wanted)}")
    exempt = set(re.findall(r'resource\.type\s*!=\s*"([^"]*)"', expression))
    if re.search(r'resource\.type\s*==|\btrue\b', expression) or not {
            "compute.googleapis.com/Instance", "compute.googleapis.com/Disk"} <= exempt:
        problems.append("only the resource types other than compute.googleapis.com/Instance and /Disk may be exempt "
                        "from the name condition")
    return problems


def gcp_head_binding_problems(cfg: dict, iam_dir: Path, readme: str) -> list[str]:
    """The head account's project-level binding (in the README's setup commands) carries the IAM condition of
    iam/gcp-<account>-condition.yaml, which limits it to this cluster's instances."""
    provider, cluster = cfg.get("provider", {}), cfg.get("cluster_name", "")
    head = cfg["available_node_types"][cfg["head_node_type"]].get("node_config", {})
    email = ((head.get("serviceAccounts") or [{}])[0]).get("email") or ""
    if not email:
        return []  # no head account at all: gcp_trust_problems names it
    account = email.split("@")[0]
    bindings = _binding_commands(readme, account)
    where = "cluster/README.md's `gcloud projects add-iam-policy-binding` for " + account
    if not bindings:
        return [f"{where}: not found (the head's role must be bound with its condition)"]
    problems, condition_file = [], iam_dir / f"gcp-{account}-condition.yaml"
    for flags in bindings:
        if Path(flags.get("condition-from-file", "")).name != condition_file.name:
            problems.append(f"{where}: bound project-wide without --condition-from-file=cluster/filled/iam/"
                            f"{condition_file.name}: the head could change or delete every VM of the project")
    if not condition_file.exists():
        return problems + [f"{condition_file.name}: the head binding's IAM condition is missing"]
    expression = str((yaml.safe_load(condition_file.read_text()) or {}).get("expression", ""))
    zones = [z.strip() for z in str(provider.get("availability_zone", "")).split(",") if z.strip()]
    return problems + [f"{condition_file.name}: {p}" for p in
                       _condition_problems(expression, str(provider.get("project_id", "")), zones, cluster)]
