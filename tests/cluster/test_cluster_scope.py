"""What the cluster trusts no more than it must (cluster/preflight/trust_iam.py, trust_kube.py, trust_cloud.py): the
head's cloud rights scoped to this cluster's instances, the Ray pods kept from the metadata endpoint, the head's API
token in the autoscaler sidecar only, a Pod Security level, and MLflow's admin login the server's alone. Each rule
passes on the shipped files and names the problem in the wide forms it replaced. Plus the head's MLflow start
command run against a stub `mlflow`, and cluster/mlflow_users.py's refusals (its work against a real server:
tests/service/test_mlflow_auth.py)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cluster"))

import mlflow_users  # noqa: E402
from preflight.common import KUBERAY, KUBERAY_MLFLOW, KUBERAY_NAMESPACE, LAUNCHERS, load_docs, load_yaml  # noqa: E402
from preflight.trust_cloud import aws_trust_problems, vm_mlflow_problems  # noqa: E402
from preflight.trust_iam import aws_head_scope_problems, gcp_head_binding_problems  # noqa: E402
from preflight.trust_kube import (head_token_problems, metadata_egress_problems, mlflow_auth_problems,  # noqa: E402
                                  pod_security_problems, ray_token_problems, service_account_problems,
                                  service_exposure_problems)

IAM = ROOT / "cluster" / "iam"
README = (ROOT / "cluster" / "README.md").read_text()
ROLE = "qed-ray-head"


# ---- AWS: the head's EC2 rights --------------------------------------------------------------------------------
def _policy(edit=lambda statements: None) -> dict:
    policy = json.loads((IAM / "aws-qed-ray-head.json").read_text())
    edit(policy["Statement"])
    return policy


def _statement(statements: list[dict], sid: str) -> dict:
    return next(s for s in statements if s["Sid"] == sid)


RUN, RETAG, TERMINATE = ("AutoscalerLaunchesOnlyThisClustersWorkerType",
                         "AutoscalerRetagsOnlyThisClustersNodesNeverTheirClusterTag",
                         "AutoscalerTerminatesOnlyThisClustersNodes")
WIDE_RUN = f"{ROLE}: ec2:RunInstances on '*'; allow it on the instance resource (arn:aws:ec2:<region>:<account>:" \
           f"instance/*) under the cluster's tag, and on the images, subnets, security groups, interfaces, volumes " \
           f"separately"
WIDE_TAGS = f"{ROLE}: ec2:CreateTags only at launch (ec2:CreateAction RunInstances) or on instances tagged " \
            f"ray-cluster-name=qed-ray without touching that key (ForAllValues:StringNotEquals aws:TagKeys): " \
            f"otherwise the head can tag any instance as this cluster's and terminate it"
UNTAGGED_RUN = f"{ROLE}: ec2:RunInstances must require the tag ray-cluster-name=qed-ray on what it launches " \
               f"(StringEquals aws:RequestTag/ray-cluster-name)"
ANY_TYPE = f"{ROLE}: ec2:RunInstances may launch any instance type; limit ec2:InstanceType to the workers' " \
           f"['g5.4xlarge']"
WIDE_TERMINATE = f"{ROLE}: ec2:TerminateInstances must be limited to this cluster's instances (StringEquals " \
                 f"ec2:ResourceTag/ray-cluster-name: qed-ray)"


@pytest.mark.parametrize("policy, expected", [
    # RunInstances and CreateTags on '*' without any condition.
    ({"Statement": [{"Effect": "Allow", "Action": ["ec2:RunInstances", "ec2:CreateTags"], "Resource": "*"}]},
     [WIDE_RUN, WIDE_TAGS]),
    (_policy(lambda st: _statement(st, RUN).pop("Condition")), [UNTAGGED_RUN, ANY_TYPE]),
    (_policy(lambda st: _statement(st, RUN)["Condition"]["StringEquals"].pop("ec2:InstanceType")), [ANY_TYPE]),
    (_policy(lambda st: _statement(st, RETAG)["Condition"].pop("ForAllValues:StringNotEquals")), [WIDE_TAGS]),
    (_policy(lambda st: _statement(st, RETAG).pop("Condition")), [WIDE_TAGS]),
    (_policy(lambda st: _statement(st, TERMINATE).pop("Condition")), [WIDE_TERMINATE]),
    (_policy(lambda st: _statement(st, TERMINATE)["Condition"]["StringEquals"].update(
        {"ec2:ResourceTag/ray-cluster-name": "*"})), [WIDE_TERMINATE]),
], ids=["all-unconditioned", "run-unconditioned", "any-type", "retag-cluster-key", "retag-anything",
        "terminate-anything", "terminate-any-tag-value"])
def test_the_head_launches_tags_and_terminates_only_this_clusters_instances(policy, expected):
    assert aws_head_scope_problems(ROLE, _policy(), "qed-ray", {"g5.4xlarge"}) == []
    assert aws_head_scope_problems(ROLE, policy, "qed-ray", {"g5.4xlarge"}) == expected


def test_the_policy_must_follow_the_configs_cluster_name_and_worker_type():
    cfg = load_yaml(ROOT / LAUNCHERS["aws"])
    assert aws_trust_problems(cfg, IAM) == []
    cfg["cluster_name"] = "other"
    cfg["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"] = "g6.xlarge"
    assert [p for p in aws_trust_problems(cfg, IAM) if "ec2:" in p] == [
        f"{ROLE}: ec2:RunInstances must require the tag ray-cluster-name=other on what it launches (StringEquals "
        f"aws:RequestTag/ray-cluster-name)",
        f"{ROLE}: ec2:InstanceType ['g5.4xlarge'] lacks the workers' ['g6.xlarge']: the autoscaler could not launch "
        f"them",
        WIDE_TAGS.replace("=qed-ray", "=other"),
        WIDE_TERMINATE.replace(": qed-ray)", ": other)")]


# ---- GCP: the head's binding carries its IAM condition ----------------------------------------------------------
CONDITION = "gcp-qed-ray-head-condition.yaml"
UNCONDITIONED = f"cluster/README.md's `gcloud projects add-iam-policy-binding` for {ROLE}: bound project-wide " \
                f"without --condition-from-file=cluster/filled/iam/{CONDITION}: the head could change or delete " \
                f"every VM of the project"


def _condition(tmp_path: Path, edit) -> Path:
    iam = Path(shutil.copytree(IAM, tmp_path / "iam"))
    doc = yaml.safe_load((iam / CONDITION).read_text())
    doc["expression"] = edit(doc["expression"])
    (iam / CONDITION).write_text(yaml.safe_dump(doc))
    return iam


def test_the_gcp_head_role_is_bound_only_to_this_clusters_instances(tmp_path):
    cfg = load_yaml(ROOT / LAUNCHERS["gcp"])
    assert gcp_head_binding_problems(cfg, IAM, README) == []
    unconditioned = README.replace(" \\\n  --condition-from-file=cluster/filled/iam/" + CONDITION, "")
    assert gcp_head_binding_problems(cfg, IAM, unconditioned) == [UNCONDITIONED]
    assert gcp_head_binding_problems(cfg, IAM, README.replace("add-iam-policy-binding \"$QED_GCP", "x")) == [
        f"cluster/README.md's `gcloud projects add-iam-policy-binding` for {ROLE}: not found (the head's role must "
        f"be bound with its condition)"]
    other = _condition(tmp_path / "a", lambda e: e.replace("ray-qed-ray-", "ray-other-"))
    assert gcp_head_binding_problems(cfg, other, README) == [
        f"{CONDITION}: the condition must limit instances to the names Ray gives this cluster: resource.name."
        f"startsWith(\"projects/your-gcp-project/zones/<zone>/instances/ray-qed-ray-\") for the zones "
        f"['us-central1-a']",
        f"{CONDITION}: the condition admits other names: ['projects/your-gcp-project/zones/us-central1-a/disks/"
        f"ray-other-', 'projects/your-gcp-project/zones/us-central1-a/instances/ray-other-']"]
    always = _condition(tmp_path / "b", lambda e: e + " || true")
    assert gcp_head_binding_problems(cfg, always, README) == [
        f"{CONDITION}: only the resource types other than compute.googleapis.com/Instance and /Disk may be exempt "
        f"from the name condition"]
    (other / CONDITION).unlink()
    assert gcp_head_binding_problems(cfg, other, README) == [
        f"{CONDITION}: the head binding's IAM condition is missing"]


# ---- VMs: the MLflow admin login is the server's --------------------------------------------------------------
ADMIN_IS_CLIENTS = "the MLflow admin's login is the clients' (MLFLOW_TRACKING_USERNAME/PASSWORD): every trial would " \
                   "be an admin; the server reads its own from ~/mlflow/admin.env"
NO_ADMIN_FILE = "the MLflow server must read its admin login from ~/mlflow/admin.env, generated owner-only (umask " \
                "077) on the head"


def _admin_login_of_the_clients(cfg: dict) -> None:
    """The head's MLflow start as it was: the admin login taken from the clients' variables, no clients' user."""
    start = [c for c in cfg["head_start_ray_commands"] if "mlflow server" in c][0]
    start = start[:start.index("{ [ -s ~/mlflow/admin.env ]")] + start[start.index("if [ -f ~/mlflow/server.pid ]"):]
    start = start.replace("(set -a && . ~/mlflow/admin.env && set +a && { ", "(").replace(" & } && echo", " & echo")
    start = start.replace("MLFLOW_AUTH_CONFIG_PATH=", 'MLFLOW_AUTH_ADMIN_USERNAME="$MLFLOW_TRACKING_USERNAME" '
                                                      'MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD" '
                                                      'MLFLOW_AUTH_CONFIG_PATH=')
    cfg["head_start_ray_commands"] = ["ray stop", start, cfg["head_start_ray_commands"][-1]]


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
@pytest.mark.parametrize("mutate, expected", [
    (_admin_login_of_the_clients, [ADMIN_IS_CLIENTS, NO_ADMIN_FILE, "head_start_ray_commands must create the clients' user: "
                        "python ~/qed-ray/cluster/mlflow_users.py --admin-env ~/mlflow/admin.env --client-env "
                        "~/.qed/mlflow.env"]),
    (lambda cfg: cfg["file_mounts"].update({"~/mlflow/admin.env": "~/.qed/mlflow-admin.env"}),
     ["~/mlflow/admin.env must stay on the head, out of file_mounts and of the nodes' environment"]),
    (lambda cfg: cfg["setup_commands"].append("cat ~/mlflow/admin.env >> ~/qed_env.sh"),
     ["~/mlflow/admin.env must stay on the head, out of file_mounts and of the nodes' environment"]),
], ids=["admin-is-clients", "admin-file-copied", "admin-in-node-env"])
def test_vm_clients_never_hold_the_mlflow_admin_login(provider, mutate, expected):
    cfg = load_yaml(ROOT / LAUNCHERS[provider])
    assert vm_mlflow_problems(cfg) == []
    mutate(cfg)
    assert vm_mlflow_problems(cfg) == expected


def test_head_mlflow_start_gives_the_server_an_admin_login_of_its_own(tmp_path):
    """The head's MLflow start command, run in a scratch HOME against a stub `mlflow` that records its environment
    and arguments: the admin login is generated once, owner-only, and reaches only the server's environment."""
    cfg = load_yaml(ROOT / LAUNCHERS["aws"])
    start = [c for c in cfg["head_start_ray_commands"] if "mlflow server" in c][0]
    (tmp_path / ".qed").mkdir()
    (tmp_path / ".qed" / "mlflow.env").write_text("MLFLOW_TRACKING_USERNAME=qed-client\nMLFLOW_TRACKING_PASSWORD=c1\n")
    (tmp_path / "qed_env.sh").write_text("export QED_MLFLOW_BACKEND_STORE_URI=sqlite:////x/mlflow.db "
                                         "QED_MLFLOW_ARTIFACTS=s3://b/p\nset -a; . ~/.qed/mlflow.env; set +a\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mlflow").write_text('#!/bin/bash\n{ echo "ARGV $*"; env; } > "$HOME/seen.tmp" && '
                                    'mv "$HOME/seen.tmp" "$HOME/seen"\n')
    (bin_dir / "mlflow").chmod(0o755)
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin"}

    def run() -> dict[str, str]:
        (tmp_path / "seen").unlink(missing_ok=True)
        subprocess.run(["bash", "-c", start], env=env, check=True, timeout=60)
        deadline = time.time() + 30
        while not (tmp_path / "seen").exists():
            assert time.time() < deadline
            time.sleep(0.05)
        lines = (tmp_path / "seen").read_text().splitlines()
        return {"ARGV": lines[0][5:], **dict(ln.split("=", 1) for ln in lines[1:] if "=" in ln)}

    seen = run()
    admin_file = tmp_path / "mlflow" / "admin.env"
    admin = dict(ln.split("=", 1) for ln in admin_file.read_text().splitlines())
    assert stat.S_IMODE(admin_file.stat().st_mode) == 0o600
    assert sorted(admin) == ["MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_AUTH_ADMIN_USERNAME",
                             "MLFLOW_FLASK_SERVER_SECRET_KEY"]
    assert admin["MLFLOW_AUTH_ADMIN_USERNAME"] == "qed-admin" and len(admin["MLFLOW_AUTH_ADMIN_PASSWORD"]) == 32
    assert {k: seen[k] for k in admin} == admin  # the server's environment, from the file...
    assert (seen["MLFLOW_TRACKING_USERNAME"], seen["MLFLOW_TRACKING_PASSWORD"]) == ("qed-client", "c1")  # not these
    assert seen["MLFLOW_AUTH_CONFIG_PATH"] == f"{tmp_path}/mlflow/basic_auth.ini"
    assert seen["ARGV"] == "server --app-name basic-auth --artifacts-destination s3://b/p --host 0.0.0.0 --port 5000"
    assert (tmp_path / "mlflow" / "server.pid").read_text().strip().isdigit()
    (tmp_path / "mlflow" / "server.pid").unlink()  # (a rerun would stop the previous server first: 2 s)
    assert run()["MLFLOW_AUTH_ADMIN_PASSWORD"] == admin["MLFLOW_AUTH_ADMIN_PASSWORD"]  # generated once, kept


# ---- KubeRay ---------------------------------------------------------------------------------------------------
def _docs():
    return (copy.deepcopy(load_docs(ROOT / KUBERAY)), copy.deepcopy(load_docs(ROOT / KUBERAY_MLFLOW)),
            copy.deepcopy(load_docs(ROOT / KUBERAY_NAMESPACE)))


def _find(docs, kind, name=None):
    return next(d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"]))


def _pod(r, group="head"):
    spec = _find(r, "RayCluster")["spec"]
    return (spec["headGroupSpec"] if group == "head" else spec["workerGroupSpecs"][0])["template"]["spec"]


def _egress(r):
    return _find(r, "NetworkPolicy", "qed-ray-egress")["spec"]


NO_EGRESS_POLICY = "the Ray pods need an Egress NetworkPolicy that excepts the metadata endpoint 169.254.169.254, " \
                   "fd00:ec2::254, fd20:ce::254 (open egress: trial code can ask it for the node's credentials)"
EXCEPTS = "except 169.254.169.254/32, fd00:ec2::254/128, fd20:ce::254/128 from its ipBlocks"
ALLOW_ALL = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
             "metadata": {"name": "allow-all", "namespace": "qed"},
             "spec": {"podSelector": {}, "policyTypes": ["Egress"], "egress": [{}]}}
ADMIN_SECRET = "the Ray pods use the MLflow admin's Secret ['qed-mlflow-client']: every trial would be an MLflow " \
               "admin; they log in as the clients' user (its own Secret, cluster/mlflow_users.py)"


def _server_env(m, name):
    return next(e for e in _find(m, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
                if e["name"] == name)


def _admin_secret_is_the_clients(r, m, n):
    """Manifests whose server admin login is the Ray pods' (one Secret for both)."""
    for name, key in (("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_TRACKING_USERNAME"),
                      ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_TRACKING_PASSWORD")):
        _server_env(m, name)["valueFrom"]["secretKeyRef"] = {"name": "qed-mlflow-client", "key": key}


KUBE_CASES = [  # (id, check, mutate(ray, mlflow, namespace), problems)
    ("no-egress-policy", metadata_egress_problems,
     lambda r, m, n: r.remove(_find(r, "NetworkPolicy", "qed-ray-egress")), [NO_EGRESS_POLICY]),
    ("egress-policy-elsewhere", metadata_egress_problems,
     lambda r, m, n: _egress(r)["podSelector"].update(matchLabels={"app": "other"}), [NO_EGRESS_POLICY]),
    ("metadata-not-excepted", metadata_egress_problems, lambda r, m, n: _egress(r)["egress"][0]["to"][1]["ipBlock"].pop(
        "except"), [f"NetworkPolicy qed-ray-egress: admits egress to ['169.254.169.254']; {EXCEPTS}"]),
    ("ipv6-metadata-not-excepted", metadata_egress_problems,
     lambda r, m, n: _egress(r)["egress"][0]["to"][2]["ipBlock"].update({"except": ["fd00::/64"]}),
     [f"NetworkPolicy qed-ray-egress: admits egress to ['fd00:ec2::254', 'fd20:ce::254']; {EXCEPTS}"]),
    ("gce-ipv6-metadata-not-excepted", metadata_egress_problems,  # GCE's IPv6 metadata address
     lambda r, m, n: _egress(r)["egress"][0]["to"][2]["ipBlock"].update({"except": ["fd00:ec2::254/128"]}),
     [f"NetworkPolicy qed-ray-egress: admits egress to ['fd20:ce::254']; {EXCEPTS}"]),
    ("a-policy-admitting-all-egress", metadata_egress_problems, lambda r, m, n: r.append(ALLOW_ALL),
     [f"NetworkPolicy allow-all: admits egress to ['every destination']; {EXCEPTS}"]),
    ("host-network", metadata_egress_problems, lambda r, m, n: _pod(r, "gpu").update(hostNetwork=True),
     ["gpu: hostNetwork puts the pod on the node's namespaces, past its NetworkPolicies and the metadata hop limit"]),
    ("head-token-pod-wide", service_account_problems,
     lambda r, m, n: _pod(r).update(automountServiceAccountToken=True),
     ["head: automountServiceAccountToken must be false: a pod-wide token also sits in ray-head, which runs the "
      "driver and every submitted job"]),
    ("sidecar-without-token", head_token_problems,
     lambda r, m, n: _find(r, "RayCluster")["spec"]["autoscalerOptions"].pop("volumeMounts"),
     ["autoscaler sidecar: needs the head account's token, a projected serviceAccountToken volume of the head pod "
      "mounted at /var/run/secrets/kubernetes.io/serviceaccount (autoscalerOptions.volumeMounts)"]),
    ("ray-head-with-token", head_token_problems, lambda r, m, n: _pod(r)["containers"][0]["volumeMounts"].append(
        {"name": "kube-api-access", "mountPath": "/tokens"}),
     ["head/ray-head: mounts the API token; only the autoscaler sidecar may"]),
    ("clients-log-in-as-admin", mlflow_auth_problems, _admin_secret_is_the_clients, [ADMIN_SECRET]),
    ("autoscaler-holds-admin-secret", mlflow_auth_problems, lambda r, m, n: (
        _admin_secret_is_the_clients(r, m, n), _find(r, "RayCluster")["spec"]["autoscalerOptions"]["env"].append(
            {"name": "X", "valueFrom": {"secretKeyRef": {"name": "qed-mlflow-client", "key": "y"}}})), [ADMIN_SECRET]),
    ("namespace-without-level", None, lambda r, m, n: n[0]["metadata"].pop("labels"),
     ["namespace 'qed': needs a Pod Security level, the label pod-security.kubernetes.io/enforce: baseline (or "
      "restricted), got None"]),
    ("privileged-level", None, lambda r, m, n: n[0]["metadata"]["labels"].update(
        {"pod-security.kubernetes.io/enforce": "privileged"}),
     ["namespace 'qed': needs a Pod Security level, the label pod-security.kubernetes.io/enforce: baseline (or "
      "restricted), got 'privileged'"]),
    ("restricted-refuses-the-init-container", None, lambda r, m, n: n[0]["metadata"]["labels"].update(
        {"pod-security.kubernetes.io/enforce": "restricted"}),
     ["namespace 'qed': level restricted refuses the root containers ['results-permissions']; use baseline"]),
    ("another-namespace", None, lambda r, m, n: n[0]["metadata"].update(name="default"),
     ["namespace 'qed': needs a Pod Security level, the label pod-security.kubernetes.io/enforce: baseline (or "
      "restricted), got None"]),
    ("load-balancer", service_exposure_problems, lambda r, m, n: _find(m, "Service")["spec"].update(
        type="LoadBalancer"),
     ["Service mlflow: type LoadBalancer; ClusterIP only (people reach it with kubectl port-forward)"]),
    ("head-node-port", service_exposure_problems, lambda r, m, n: _find(r, "RayCluster")["spec"]["headGroupSpec"]
     .update(serviceType="NodePort"), ["headGroupSpec: serviceType ClusterIP and no enableIngress (the job API runs "
                                       "any code)"]),
    ("no-token-auth", ray_token_problems, lambda r, m, n: _pod(r, "gpu")["containers"][0].update(env=[
        e for e in _pod(r, "gpu")["containers"][0]["env"] if e["name"] != "RAY_AUTH_TOKEN"]),
     ["gpu/ray-worker: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret (the job API runs any code for whoever "
      "reaches it)"]),
]


def _run(check, r, m, n):
    return pod_security_problems(n, r) if check is None else check(r, m)


@pytest.mark.parametrize("name, check, mutate, expected", KUBE_CASES, ids=[c[0] for c in KUBE_CASES])
def test_kuberay_trusts_no_more_than_it_must(name, check, mutate, expected):
    r, m, n = _docs()
    assert _run(check, r, m, n) == []
    mutate(r, m, n)
    assert _run(check, r, m, n) == expected


# ---- cluster/mlflow_users.py, without a server -------------------------------------------------------------------
def _env_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_login_files_must_be_owner_only_and_complete(tmp_path):
    keys = mlflow_users.CLIENT_KEYS
    good = _env_file(tmp_path / "ok.env",
                     "# clients\nMLFLOW_TRACKING_USERNAME=qed-client\nMLFLOW_TRACKING_PASSWORD=p=1\n")
    assert mlflow_users.read_login(good, keys) == ("qed-client", "p=1")
    shared = _env_file(tmp_path / "shared.env", good.read_text(), 0o640)
    with pytest.raises(mlflow_users.UsersError, match=rf"^{shared}: readable by other users \(mode 640\); chmod 600"):
        mlflow_users.read_login(shared, keys)
    partial = _env_file(tmp_path / "partial.env", "MLFLOW_TRACKING_USERNAME=qed-client\n")
    with pytest.raises(mlflow_users.UsersError) as err:
        mlflow_users.read_login(partial, keys)
    assert str(err.value) == (f"{partial}: no MLFLOW_TRACKING_PASSWORD (expected MLFLOW_TRACKING_USERNAME=... and "
                              f"MLFLOW_TRACKING_PASSWORD=... lines)")


def test_the_tool_refuses_to_make_the_clients_admins_before_calling_anyone(tmp_path, capsys):
    admin = _env_file(tmp_path / "admin.env", "MLFLOW_AUTH_ADMIN_USERNAME=qed\nMLFLOW_AUTH_ADMIN_PASSWORD=a\n")
    client = _env_file(tmp_path / "client.env", "MLFLOW_TRACKING_USERNAME=qed\nMLFLOW_TRACKING_PASSWORD=c\n")
    with pytest.raises(mlflow_users.UsersError, match="^the clients' user 'qed' is the MLflow admin: every trial"):
        mlflow_users.ensure_client("http://127.0.0.1:9", mlflow_users.Login("qed", "a"), mlflow_users.Login("qed", "c"))
    files = ["--admin-env", str(admin), "--client-env", str(client)]
    assert mlflow_users.main(["--tracking-uri", "sqlite:///x.db", *files]) == 1
    assert capsys.readouterr().err == "error: --tracking-uri must be the MLflow server's http(s) URL, got " \
                                      "'sqlite:///x.db'\n"
    assert mlflow_users.main(["--tracking-uri", "http://127.0.0.1:9", *files]) == 1  # nothing listens on port 9
    assert capsys.readouterr().err == "error: the MLflow server at http://127.0.0.1:9 did not answer /health " \
                                      "within 0 s\n"
    assert os.environ.get("MLFLOW_TRACKING_PASSWORD") not in ("a", "c")
