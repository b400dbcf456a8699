"""The threat model of cluster/README.md is enforced: every row names the pre-flight checks (functions of
cluster/preflight/) that hold its protections, and taking each protection out of a copy of the shipped files makes
`python cluster/check.py`'s run fail with that check's message.

One scratch checkout carries every removal at once, so the whole pre-flight runs once (the shipped files passing is
tests/cluster/test_cluster.py::test_every_check_passes_on_the_shipped_files).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cluster"))

from preflight import run_all  # noqa: E402
from preflight.common import KUBERAY, KUBERAY_MLFLOW  # noqa: E402

AWS, GCP, KUBE = "cluster/aws.yaml", "cluster/gcp.yaml", f"{KUBERAY} + {KUBERAY_MLFLOW}"
IMAGE, IGNORE = "docker/Dockerfile + image references", ".rayignore + .dockerignore"


# ---- edits of a scratch checkout ----------------------------------------------------------------------------------
def _yaml(rel: str, mutate: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        doc = yaml.safe_load((root / rel).read_text())
        mutate(doc)
        (root / rel).write_text(yaml.safe_dump(doc, sort_keys=False, width=10_000))
    return edit


def _docs(rel: str, mutate: Callable[[list[dict]], object]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        docs = [d for d in yaml.safe_load_all((root / rel).read_text()) if d]
        mutate(docs)
        (root / rel).write_text(yaml.safe_dump_all(docs, sort_keys=False, width=10_000))
    return edit


def _json(rel: str, mutate: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        doc = json.loads((root / rel).read_text())
        mutate(doc)
        (root / rel).write_text(json.dumps(doc))
    return edit


def _text(rel: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        text = (root / rel).read_text()
        assert old in text, (rel, old)
        (root / rel).write_text(text.replace(old, new))
    return edit


def _node(name: str) -> Callable[[dict], dict]:
    return lambda cfg: cfg["available_node_types"][name]["node_config"]


def _commands(key: str, old: str, new: str) -> Callable[[dict], None]:
    def mutate(cfg: dict) -> None:
        assert any(old in c for c in cfg[key]), (key, old)
        cfg[key] = [c.replace(old, new) for c in cfg[key]]
    return mutate


def _kind(docs: list[dict], kind: str, name: str | None = None) -> dict:
    return next(d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"]))


def _cr(docs: list[dict]) -> dict:
    return _kind(docs, "RayCluster")["spec"]


def _pod(docs: list[dict], group: str) -> dict:
    spec = _cr(docs)
    group_spec = spec["headGroupSpec"] if group == "head" else spec["workerGroupSpecs"][0]
    return group_spec["template"]["spec"]


def _mlflow_container(docs: list[dict]) -> dict:
    return _kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def _client_secret_to_admin(docs: list[dict]) -> None:
    for e in _pod(docs, "gpu")["containers"][0]["env"]:
        if e["name"].startswith("MLFLOW_TRACKING_U") or e["name"] == "MLFLOW_TRACKING_PASSWORD":
            key = e["name"].replace("TRACKING", "AUTH_ADMIN")
            e["valueFrom"] = {"secretKeyRef": {"name": "qed-mlflow-admin", "key": key}}


def _add_worker_policy(root: Path) -> None:
    write = {"Effect": "Allow", "Action": ["s3:PutObject"], "Resource": "*"}
    (root / "cluster/iam/aws-qed-ray-worker.json").write_text(json.dumps({"Statement": [write]}))


HEAD = "the head (the job driver, the autoscaler, MLflow; so every submitted job)"
OLD_AWS_TAGGING = {"Effect": "Allow", "Action": ["ec2:RunInstances", "ec2:CreateTags"], "Resource": "*"}
HEAD_POLICY, EFS_POLICY = "cluster/iam/aws-qed-ray-head.json", "cluster/iam/aws-efs-policy.json"
GCP_ROLE, FILESTORE = "cluster/iam/gcp-qed-ray-head.yaml", "cluster/gcp-filestore.yaml"
ADMIN_FROM_CLIENTS = ('MLFLOW_AUTH_ADMIN_USERNAME="$MLFLOW_TRACKING_USERNAME" '
                      'MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD" MLFLOW_AUTH_CONFIG_PATH=')

# (row, cited check) -> (pre-flight section, an edit that takes the row's protection out, the check's message).
REMOVALS: dict[tuple[str, str], tuple[str, Callable[[Path], None], str]] = {
    ("the internet", "trust_cloud.aws_node_problems"): (
        AWS, _yaml(AWS, lambda c: _node("gpu_worker")(c).pop("SecurityGroupIds")),
        "SecurityGroupIds must name the pre-created node group"),
    ("the internet", "trust_cloud.gcp_network_problems"): (
        GCP, _yaml(GCP, lambda c: _node("gpu_worker")(c).pop("tags")), "node types need a common network tag"),
    ("the internet", "trust_kube.service_exposure_problems"): (
        KUBE, _docs(KUBERAY_MLFLOW, lambda d: _kind(d, "Service")["spec"].update(type="LoadBalancer")),
        "ClusterIP only (people "),
    ("other machines of the VPC / project network", "trust_cloud.aws_node_problems"): (
        AWS, _yaml(AWS, _commands("initialization_commands", "-o tls,iam fs-", "-o tls fs-")),
        "mount the shared file system with `mount -t efs -o tls,iam`"),
    ("other machines of the VPC / project network", "trust_cloud.efs_policy_problems"): (
        AWS, _json(EFS_POLICY, lambda p: p["Statement"].pop(0)), "deny requests without TLS"),
    ("other machines of the VPC / project network", "trust_cloud.gcp_network_problems"): (
        GCP, _yaml(GCP, lambda c: _node("head")(c).update(networkInterfaces=[{"network": "global/networks/default"}])),
        "put the node in the cluster's own subnetwork"),
    ("other machines of the VPC / project network", "trust_cloud.filestore_problems"): (
        GCP, _yaml(FILESTORE, lambda f: f["--file-share"]["nfs-export-options"][1].update(
            {"ip-ranges": ["0.0.0.0/0"]})),
        "must be the cluster's private"),
    ("other pods of the Kubernetes cluster", "trust_kube.network_policy_problems"): (
        KUBE, _docs(KUBERAY, lambda d: d.remove(_kind(d, "NetworkPolicy", "qed-ray"))),
        "the Ray pods need an Ingress NetworkPolicy admitting only pods with ray.io/cluster: "),
    ("you (a laptop with the token)", "launcher.environment_problems"): (
        AWS, _yaml(AWS, _commands("setup_commands", '"RAY_AUTH_MODE=token"', '"RAY_AUTH_MODE=disabled"')),
        "setup_commands must export RAY_AUTH_MODE=token"),
    ("you (a laptop with the token)", "trust_kube.ray_token_problems"): (
        KUBE, _docs(KUBERAY, lambda d: _cr(d)["autoscalerOptions"].update(env=[])),
        "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret (the job API runs any "),
    ("you (a laptop with the token)", "trust_cloud.vm_mlflow_problems"): (
        GCP, _yaml(GCP, _commands("head_start_ray_commands", "--app-name basic-auth", "")),
        "the MLflow server must run `--app-name basic-auth`"),
    ("you (a laptop with the token)", "trust_kube.mlflow_auth_problems"): (
        KUBE, _docs(KUBERAY_MLFLOW, lambda d: _mlflow_container(d).update(
            args=[a.replace("--app-name basic-auth", "") for a in _mlflow_container(d)["args"]])),
        "MLflow must run `--app-name basic-auth`"),
    ("a trial (code of a sweep, on a GPU worker)", "trust_cloud.worker_policy_problems"): (
        AWS, _add_worker_policy, "workers run trial code and may not be allowed"),
    ("a trial (code of a sweep, on a GPU worker)", "trust_cloud.gcp_trust_problems"): (
        GCP, _yaml(GCP, lambda c: _node("gpu_worker")(c).update(serviceAccounts=[{
            "email": "qed-ray-head@your-gcp-project.iam.gserviceaccount.com", "scopes": []}])),
        "workers run trial code; no service account, or one with the"),
    ("a trial (code of a sweep, on a GPU worker)", "trust_kube.service_account_problems"): (
        KUBE, _docs(KUBERAY, lambda d: _pod(d, "gpu").update(automountServiceAccountToken=True)),
        "automountServiceAccountToken must be false (nothing there calls the "),
    ("a trial (code of a sweep, on a GPU worker)", "trust_cloud.aws_node_problems"): (
        AWS, _yaml(AWS, lambda c: _node("gpu_worker")(c)["MetadataOptions"].update(HttpPutResponseHopLimit=2)),
        "MetadataOptions must require IMDSv2 tokens with hop limit 1"),
    ("a trial (code of a sweep, on a GPU worker)", "trust_kube.metadata_egress_problems"): (
        KUBE, _docs(KUBERAY, lambda d: _kind(d, "NetworkPolicy", "qed-ray-egress")["spec"]["egress"][0]["to"][1][
            "ipBlock"].pop("except")), "admits egress to "),
    ("a trial (code of a sweep, on a GPU worker)", "trust_cloud.vm_mlflow_problems"): (
        AWS, _yaml(AWS, _commands("head_start_ray_commands", "MLFLOW_AUTH_CONFIG_PATH=", ADMIN_FROM_CLIENTS)),
        "the MLflow admin's login is the clients' (MLFLOW_TRACKING_USERNAME/PASSWORD): every trial "),
    ("a trial (code of a sweep, on a GPU worker)", "trust_kube.mlflow_auth_problems"): (
        KUBE, _docs(KUBERAY, _client_secret_to_admin), "the Ray pods use the MLflow admin's Secret"),
    ("a trial (code of a sweep, on a GPU worker)", "supply.sudo_problems"): (
        IMAGE, _text("docker/Dockerfile", "RUN sed -i '/NOPASSWD/d' /etc/sudoers", "RUN true"),
        "the Dockerfile must remove the base image's NOPASSWD sudo rule"),
    ("a trial (code of a sweep, on a GPU worker)", "trust_kube.security_context_problems"): (
        KUBE, _docs(KUBERAY_MLFLOW, lambda d: _mlflow_container(d)["securityContext"].update(
            allowPrivilegeEscalation=True)), "allowPrivilegeEscalation must be false"),
    (HEAD, "trust_iam.aws_head_scope_problems"): (
        AWS, _json(HEAD_POLICY, lambda p: p["Statement"].append(OLD_AWS_TAGGING)), "ec2:CreateTags only at launch"),
    (HEAD, "trust_cloud.head_policy_problems"): (
        AWS, _json(HEAD_POLICY, lambda p: p["Statement"].append(
            {"Effect": "Allow", "Action": "iam:CreateRole", "Resource": "*"})),
        "is needed neither by the autoscaler nor by the MLflow server"),
    (HEAD, "trust_cloud.gcp_trust_problems"): (
        GCP, _yaml(GCP_ROLE, lambda r: r["includedPermissions"].append("storage.objects.create")),
        "is not needed by the autoscaler (compute only)"),
    (HEAD, "trust_iam.gcp_head_binding_problems"): (
        GCP, _text("cluster/README.md", " \\\n  --condition-from-file=cluster/filled/iam/gcp-qed-ray-head-condition.yaml",
                   ""),
        "bound project-wide without --condition-from-file"),
    (HEAD, "trust_kube.head_token_problems"): (
        KUBE, _docs(KUBERAY, lambda d: _pod(d, "head")["containers"][0]["volumeMounts"].append(
            {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})),
        "mounts the API token; only the autoscaler sidecar may"),
    (HEAD, "trust_kube.pod_security_problems"): (
        KUBE, _docs("cluster/kuberay-namespace.yaml", lambda d: d[0]["metadata"]["labels"].pop(
            "pod-security.kubernetes.io/enforce")), "needs a Pod Security level"),
    ("whoever can write the sweep folder", "trust_cloud.vm_secret_problems"): (
        GCP, _yaml(GCP, _commands("initialization_commands", " && sudo chmod 750 /mnt/qed/sweeps", "")),
        "must be closed to other users (chmod 750)"),
    ("whoever can write the sweep folder", "kuberay.shared_volume_problems"): (
        KUBE, _docs(KUBERAY, lambda d: _pod(d, "head")["initContainers"][0].update(command=[
            c.replace("chmod 750 /mnt/qed/sweeps && ", "") for c in _pod(d, "head")["initContainers"][0]["command"]])),
        "and closed to other users (chmod 750)"),
    ("whoever can write the sweep folder", "trust_cloud.efs_policy_problems"): (
        AWS, _json(EFS_POLICY, lambda p: p["Statement"][-1]["Action"].append("elasticfilesystem:ClientRootAccess")),
        "only the head keeps root"),
    ("whoever can write the sweep folder", "trust_cloud.filestore_problems"): (
        GCP, _yaml(FILESTORE, lambda f: f["--file-share"]["nfs-export-options"][1].update(
            {"squash-mode": "NO_ROOT_SQUASH"})), "root is kept only by the head's subnet"),
    ("a local user of your laptop", "supply.ignore_problems"): (
        IGNORE, _text(".rayignore", "*.key\n", ""), ": secrets not excluded: "),
    ("a local user of your laptop", "trust_cloud.vm_secret_problems"): (
        AWS, _yaml(AWS, _commands("setup_commands", "chmod 600 ~/.ray/auth_token ~/.qed/mlflow.env && ", "")),
        "setup_commands must chmod 600 "),
}


def threat_model() -> dict[str, list[str]]:
    """{who: [cited check, ...]} of the README's threat-model table (rows that hold by the service's code, not by
    the configs, cite instead the test file that shows it, which must exist)."""
    text = (ROOT / "cluster" / "README.md").read_text()
    section = text[text.index("## Threat model"):]
    section = section[:section.index("\n## ", 1)]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    assert lines[0] == "| who | can reach | cannot, because | checked by |", lines[0]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, line[:80]
        rows[cells[0]] = re.findall(r"`([a-z_]+\.[a-z_]+)`", cells[3])
        tests = re.findall(r"`(tests/[\w/]+\.py)`", cells[3])
        assert rows[cells[0]] or (tests and all((ROOT / t).is_file() for t in tests)), line[:80]
    return {who: checks for who, checks in rows.items() if checks}


def _check(name: str) -> Callable:
    module, function = name.split(".")
    return getattr(importlib.import_module(f"preflight.{module}"), function)


def _source_with_callees(func: Callable) -> str:
    """The function's source and that of the functions of its module it calls (one level)."""
    module, src = inspect.getmodule(func), inspect.getsource(func)
    callees = {getattr(module, n) for n in re.findall(r"\b(\w+)\(", src)
               if inspect.isfunction(getattr(module, n, None))}
    return "\n".join([src] + [inspect.getsource(f) for f in callees if f is not func])


def test_every_row_cites_checks_that_exist_and_name_the_problem():
    rows = threat_model()
    assert len(rows) == 8 and all(rows.values()), rows
    cited = {(who, check) for who, checks in rows.items() for check in checks}
    assert cited == set(REMOVALS)  # a citation without its removal below, or a removal no row cites, fails
    for (who, check), (_, _, message) in REMOVALS.items():
        assert message in _source_with_callees(_check(check)), (who, check, message)


@pytest.fixture(scope="module")
def broken_checkout(tmp_path_factory) -> dict[str, list[str]]:
    """run_all on a copy of the checkout with every row's protections taken out."""
    root = tmp_path_factory.mktemp("threat_model")
    for name in ("pyproject.toml", "Makefile", ".rayignore", ".dockerignore"):
        shutil.copy(ROOT / name, root / name)
    for folder in ("cluster", "docker"):
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for _, edit, _ in REMOVALS.values():
        edit(root)
    return run_all(root)


@pytest.mark.parametrize("who, check", sorted(REMOVALS),
                         ids=[re.sub(r"\W+", "-", f"{w[:24]} {c}") for w, c in sorted(REMOVALS)])
def test_taking_a_protection_out_fails_the_preflight(broken_checkout, who, check):
    section, _, message = REMOVALS[who, check]
    assert any(message in p for p in broken_checkout[section]), broken_checkout[section]
