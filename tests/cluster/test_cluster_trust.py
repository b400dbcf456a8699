"""The trust-boundary rules of the cluster pre-flight check (cluster/preflight/trust_*.py, supply.py): each passes
on the shipped files and names the problem in a broken copy. Plus what the upload filters and docker/build.sh do,
run for real (Ray's own packaging of a job's working_dir; build.sh against a stub docker)."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cluster"))

from preflight.common import (FILESTORE_FLAGS, KUBERAY, KUBERAY_MLFLOW, LAUNCHERS, load_docs,  # noqa: E402
                              load_pins, one)
from preflight.supply import (SECRET_PATTERNS, constraints_problems, ignore_problems,  # noqa: E402
                              sudo_problems)
from preflight.trust_cloud import (aws_trust_problems, efs_policy_problems, filestore_problems,  # noqa: E402
                                   gcp_trust_problems, head_policy_problems, vm_mlflow_problems,
                                   vm_secret_problems, worker_policy_problems)
from preflight.trust_kube import (mlflow_auth_problems, network_policy_problems,  # noqa: E402
                                  security_context_problems, service_account_problems)

IAM = ROOT / "cluster" / "iam"


def launcher(provider: str) -> dict:
    return yaml.safe_load((ROOT / LAUNCHERS[provider]).read_text())


def aws_problems(cfg: dict, iam: Path = IAM) -> list[str]:
    return aws_trust_problems(cfg, iam) + vm_secret_problems(cfg) + vm_mlflow_problems(cfg)


def gcp_problems(cfg: dict, iam: Path = IAM) -> list[str]:
    flags = yaml.safe_load((ROOT / FILESTORE_FLAGS).read_text())
    return gcp_trust_problems(cfg, iam, flags) + vm_secret_problems(cfg) + vm_mlflow_problems(cfg)


CHECK = {"aws": aws_problems, "gcp": gcp_problems}


def _node(cfg, name):
    return cfg["available_node_types"][name]["node_config"]


def _edit_commands(key: str, old: str, new: str):
    def mutate(cfg):
        cfg[key] = [c.replace(old, new) for c in cfg[key]]
    return mutate


# ---- VM clusters: both providers ---------------------------------------------------------------------------------
BOTH_BROKEN = [
    ("MLflow without auth", _edit_commands("head_start_ray_commands", " --app-name basic-auth", ""),
     "--app-name basic-auth"),
    ("store URI in argv", _edit_commands(
        "head_start_ray_commands", "mlflow server --app-name basic-auth",
        'mlflow server --app-name basic-auth --backend-store-uri "$QED_MLFLOW_BACKEND_STORE_URI"'),
     "--backend-store-uri puts the store URI in argv"),
    ("admin password a literal", _edit_commands(
        "head_start_ray_commands", "MLFLOW_AUTH_CONFIG_PATH=", "MLFLOW_AUTH_ADMIN_PASSWORD=hunter22 "
        "MLFLOW_AUTH_CONFIG_PATH="), "MLFLOW_AUTH_ADMIN_PASSWORD is set to a literal"),
    ("password in qed_env.sh", _edit_commands("setup_commands", '"RAY_AUTH_MODE=token";',
                                              '"RAY_AUTH_MODE=token" "MLFLOW_TRACKING_PASSWORD=hunter22";'),
     "MLFLOW_TRACKING_PASSWORD is set to a literal"),
    ("credentials not copied", lambda cfg: cfg["file_mounts"].pop("~/.qed/mlflow.env"),
     "file_mounts must copy ~/.qed/mlflow.env"),
    ("token left world-readable",
     _edit_commands("setup_commands", "chmod 600 ~/.ray/auth_token ~/.qed/mlflow.env && ", ""),
     "chmod 600 ~/.ray/auth_token"),
    ("credentials not exported", _edit_commands("setup_commands", "echo 'set -a; . ~/.qed/mlflow.env; set +a';", ""),
     "export the MLflow credentials"),
    ("sweeps folder open to all", _edit_commands("initialization_commands", " && sudo chmod 750 /mnt/qed/sweeps", ""),
     "closed to other users"),
]


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
@pytest.mark.parametrize("name,mutate,message", BOTH_BROKEN, ids=[b[0] for b in BOTH_BROKEN])
def test_vm_secret_and_mlflow_rules(provider, name, mutate, message):
    cfg = launcher(provider)
    assert CHECK[provider](cfg) == []
    mutate(cfg)
    problems = CHECK[provider](cfg)
    assert any(message in p for p in problems), problems


# ---- AWS ----------------------------------------------------------------------------------------------------------
def _profile(cfg, node, name):
    _node(cfg, node)["IamInstanceProfile"] = {"Arn": f"arn:aws:iam::123456789012:instance-profile/{name}"}


AWS_BROKEN = [
    ("workers on Ray's default profile", lambda cfg: _profile(cfg, "gpu_worker", "ray-autoscaler-v1"),
     "workers must not use the head's or Ray's profile 'ray-autoscaler-v1'"),
    ("head on Ray's default profile", lambda cfg: _profile(cfg, "head", "ray-autoscaler-v1"),
     "not Ray's ray-autoscaler-v1"),
    ("head profile without a policy file", lambda cfg: _profile(cfg, "head", "qed-admin"), "got 'qed-admin'"),
    ("Ray's default security group (SSH from anywhere)", lambda cfg: _node(cfg, "gpu_worker").pop("SecurityGroupIds"),
     "gpu_worker: SecurityGroupIds"),
    ("IMDSv1 allowed", lambda cfg: _node(cfg, "head").update(MetadataOptions={"HttpTokens": "optional",
                                                                              "HttpPutResponseHopLimit": 1}),
     "head: MetadataOptions must require IMDSv2"),
    ("metadata reachable from bridged containers", lambda cfg: _node(cfg, "gpu_worker").update(
        MetadataOptions={"HttpTokens": "required", "HttpPutResponseHopLimit": 2}), "gpu_worker: MetadataOptions"),
    ("plain NFS mount", lambda cfg: cfg.update(initialization_commands=[
        c.replace("mount -t efs -o tls,iam fs-REPLACE-ME:/",
                  "mount -t nfs4 -o nfsvers=4.1 fs-REPLACE-ME.efs.us-west-2.amazonaws.com:/")
        for c in cfg["initialization_commands"]]), "head: mount the shared file system with `mount -t efs -o tls,iam`"),
]


def test_a_worker_policy_with_write_rights_is_rejected(tmp_path):
    iam = Path(shutil.copytree(IAM, tmp_path / "iam"))
    pull = {"Effect": "Allow", "Action": ["ecr:GetAuthorizationToken", "ecr:BatchGetImage"], "Resource": "*"}
    (iam / "aws-qed-ray-worker.json").write_text(json.dumps({"Statement": [pull]}))
    assert aws_problems(launcher("aws"), iam) == []  # read-only image pull: allowed
    write = {"Effect": "Allow", "Action": ["s3:PutObject", "ec2:RunInstances"], "Resource": "*"}
    (iam / "aws-qed-ray-worker.json").write_text(json.dumps({"Statement": [pull, write]}))
    assert [p for p in aws_problems(launcher("aws"), iam) if "qed-ray-worker" in p] == [
        "qed-ray-worker: workers run trial code and may not be allowed s3:PutObject (read-only image pull at most)",
        "qed-ray-worker: workers run trial code and may not be allowed ec2:RunInstances (read-only image pull at most)"]


def _head_policy():
    return json.loads((IAM / "aws-qed-ray-head.json").read_text())


def _add(policy, action, resource="*", condition=None):
    policy["Statement"].append({"Effect": "Allow", "Action": action, "Resource": resource,
                                **({"Condition": condition} if condition else {})})
    return policy


@pytest.mark.parametrize("policy, message", [
    (_add(_head_policy(), "ec2:*"), "wildcard action 'ec2:*'"),
    (_add(_head_policy(), "iam:CreateRole"), "iam:CreateRole is needed neither"),
    (_add(_head_policy(), "iam:PassRole"), "iam:PassRole only on the workers' role"),
    (_add(_head_policy(), "s3:PutObject"), "s3:PutObject only on the MLflow artifact prefix"),
    (_add(_head_policy(), "s3:GetObject", "arn:aws:s3:::*"), "s3:GetObject only on the MLflow artifact prefix"),
])  # which instances the EC2 actions reach: tests/cluster/test_cluster_threat_model.py
def test_head_policy_keeps_only_what_the_autoscaler_and_mlflow_need(policy, message):
    assert head_policy_problems("qed-ray-head", _head_policy(), {"qed-ray-worker"}) == []
    problems = head_policy_problems("qed-ray-head", policy, {"qed-ray-worker"})
    assert len(problems) == 1 and message in problems[0], problems


def _efs(edit):
    policy = json.loads((IAM / "aws-efs-policy.json").read_text())
    edit(policy["Statement"])
    return policy


@pytest.mark.parametrize("policy, message", [
    (_efs(lambda st: st.pop(0)), "deny requests without TLS"),
    (_efs(lambda st: st[2]["Action"].append("elasticfilesystem:ClientRootAccess")), "only the head keeps root"),
    (_efs(lambda st: st[2].update(Principal={"AWS": "*"})), "allows ['*']"),
    (_efs(lambda st: st[2].update(Principal="*")), "allows ['*']"),
])
def test_efs_policy_admits_the_cluster_over_tls_and_squashes_the_workers(policy, message):
    assert efs_policy_problems(_efs(lambda st: None), "qed-ray-head", {"qed-ray-worker"}) == []
    problems = efs_policy_problems(policy, "qed-ray-head", {"qed-ray-worker"})
    assert any(message in p for p in problems), problems


def test_worker_policy_rule_on_its_own():
    assert worker_policy_problems("w", {"Statement": [{"Effect": "Deny", "Action": "*", "Resource": "*"}]}) == []
    assert worker_policy_problems("w", {"Statement": {"Effect": "Allow", "Action": "*", "Resource": "*"}}) == [
        "w: workers run trial code and may not be allowed * (read-only image pull at most)"]


# ---- GCP ----------------------------------------------------------------------------------------------------------
def _worker_account(cfg, email, scopes):
    _node(cfg, "gpu_worker")["serviceAccounts"] = [{"email": email, "scopes": scopes}]


CLOUD = "https://www.googleapis.com/auth/cloud-platform"
READ = "https://www.googleapis.com/auth/devstorage.read_only"
GCP_BROKEN = [
    ("workers on Ray's default account",
     lambda cfg: _worker_account(cfg, "ray-autoscaler-sa-v1@your-gcp-project.iam.gserviceaccount.com", [CLOUD]),
     "gpu_worker: workers run trial code"),
    ("workers on the head's account",
     lambda cfg: _worker_account(cfg, "qed-ray-head@your-gcp-project.iam.gserviceaccount.com", [READ]),
     "gpu_worker: workers run trial code"),
    ("workers with cloud-platform scope",
     lambda cfg: _worker_account(cfg, "puller@your-gcp-project.iam.gserviceaccount.com", [CLOUD]),
     "devstorage.read_only scope at most"),
    ("head on Ray's default account", lambda cfg: _node(cfg, "head").update(serviceAccounts=[
        {"email": "ray-autoscaler-sa-v1@your-gcp-project.iam.gserviceaccount.com", "scopes": [CLOUD]}]),
     "not Ray's ray-autoscaler-sa-v1"),
    ("the default network", lambda cfg: _node(cfg, "gpu_worker").update(networkInterfaces=[
        {"network": "global/networks/default"}]), "gpu_worker: networkInterfaces"),
    ("Ray picks the network", lambda cfg: _node(cfg, "head").pop("networkInterfaces"), "head: networkInterfaces"),
    ("no firewall tag", lambda cfg: _node(cfg, "gpu_worker").pop("tags"), "common network tag"),
]


BROKEN = [("aws", *b) for b in AWS_BROKEN] + [("gcp", *b) for b in GCP_BROKEN]


@pytest.mark.parametrize("cloud,name,mutate,message", BROKEN, ids=[f"{b[0]}-{b[1]}" for b in BROKEN])
def test_trust_rules(cloud, name, mutate, message):
    cfg = launcher(cloud)
    mutate(cfg)
    problems = {"aws": aws_problems, "gcp": gcp_problems}[cloud](cfg)
    assert any(message in p for p in problems), problems


def test_a_head_role_beyond_compute_is_rejected(tmp_path):
    iam = Path(shutil.copytree(IAM, tmp_path / "iam"))
    role = yaml.safe_load((iam / "gcp-qed-ray-head.yaml").read_text())
    role["includedPermissions"] += ["iam.serviceAccounts.actAs", "storage.objects.create", "compute.*"]
    (iam / "gcp-qed-ray-head.yaml").write_text(yaml.safe_dump(role))
    assert [p.split(":")[1].split()[0] for p in gcp_problems(launcher("gcp"), iam)] == [
        "iam.serviceAccounts.actAs", "storage.objects.create", "compute.*"]


def _flags(edit):
    flags = yaml.safe_load((ROOT / FILESTORE_FLAGS).read_text())
    edit(flags["--file-share"]["nfs-export-options"])
    return flags


@pytest.mark.parametrize("flags, message", [
    (_flags(lambda rules: rules.clear()), "no nfs-export-options"),
    (_flags(lambda rules: rules[1].update({"squash-mode": "NO_ROOT_SQUASH"})), "root is kept only by the head"),
    (_flags(lambda rules: rules[1].pop("squash-mode")), "must be ROOT_SQUASH"),
    (_flags(lambda rules: rules[1].update({"ip-ranges": ["0.0.0.0/0"]})), "private subnets"),
    (_flags(lambda rules: rules[1].update({"ip-ranges": ["10.0.0.0/8"]})), "/16 or smaller"),
    (_flags(lambda rules: rules[0].update({"ip-ranges": ["10.130.0.0/24"]})), "root is kept only by the head"),
    (_flags(lambda rules: rules[1].update({"ip-ranges": ["10.130.0.0/20"]})), "ip-ranges overlap"),
])
def test_filestore_exports_only_to_the_cluster_root_squashed(flags, message):
    assert filestore_problems(_flags(lambda rules: None)) == []
    problems = filestore_problems(flags)
    assert any(message in p for p in problems), problems


# ---- KubeRay ------------------------------------------------------------------------------------------------------
def _cr(docs):
    return one(docs, "RayCluster")


def _head(docs):
    return _cr(docs)["spec"]["headGroupSpec"]["template"]["spec"]


def _worker(docs):
    return _cr(docs)["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def _mlflow(docs):
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def _account(docs, name):
    return next(d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == name)


def _context(container, **changes):
    container["securityContext"] = {**container.get("securityContext", {}), **changes}


KUBE_BROKEN = [  # (name, mutate(ray_docs, mlflow_docs), message)
    ("workers on the head's account", lambda r, m: _worker(r).update(serviceAccountName="qed-ray-head"),
     "separate ServiceAccounts"),
    ("MLflow on the head's account", lambda r, m: _mlflow(m).update(serviceAccountName="qed-ray-head"),
     "separate ServiceAccounts"),
    ("undefined account", lambda r, m: _worker(r).update(serviceAccountName="qed-ray"), "'qed-ray' is not defined"),
    ("API token on workers", lambda r, m: _worker(r).update(automountServiceAccountToken=True),
     "gpu: automountServiceAccountToken must be false"),
    ("API token on MLflow", lambda r, m: (_mlflow(m).pop("automountServiceAccountToken"),
                                          _account(m, "qed-mlflow").pop("automountServiceAccountToken")),
     "mlflow: automountServiceAccountToken must be false"),
    ("bucket identity on the Ray head", lambda r, m: _account(r, "qed-ray-head")["metadata"].update(
        annotations={"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/x"}), "head: cloud identity"),
    ("container without securityContext", lambda r, m: _worker(r)["containers"][0].pop("securityContext"),
     "gpu/ray-worker: no securityContext"),
    ("autoscaler without securityContext", lambda r, m: _cr(r)["spec"]["autoscalerOptions"].pop("securityContext"),
     "autoscaler sidecar: no securityContext"),
    ("privilege escalation", lambda r, m: _context(_mlflow(m)["containers"][0], allowPrivilegeEscalation=True),
     "mlflow/mlflow: allowPrivilegeEscalation"),
    ("privileged", lambda r, m: _context(_mlflow(m)["containers"][0], privileged=True), "never privileged"),
    ("capabilities kept", lambda r, m: _context(_mlflow(m)["containers"][0], capabilities={"drop": ["NET_RAW"]}),
     "mlflow/mlflow: capabilities must drop ALL"),
    ("Ray container as root", lambda r, m: _context(_head(r)["containers"][0], runAsUser=0),
     "head/ray-head: must run as non-root"),
    ("pod lets images run as root", lambda r, m: (_mlflow(m)["securityContext"].update(runAsNonRoot=False),
                                                  _mlflow(m)["containers"][0]["securityContext"].pop("runAsNonRoot")),
     "mlflow/mlflow: must run as non-root"),
    ("init container with more than CHOWN", lambda r, m: _context(
        _head(r)["initContainers"][0], capabilities={"drop": ["ALL"], "add": ["CHOWN", "SYS_ADMIN"]}),
     "head/results-permissions: must run as non-root"),
    ("no NetworkPolicy for MLflow", lambda r, m: m.remove(one(m, "NetworkPolicy")), "the MLflow pod needs"),
    ("MLflow open to all namespaces", lambda r, m: one(m, "NetworkPolicy")["spec"]["ingress"][0]["from"].append(
        {"namespaceSelector": {}}), "the MLflow pod needs"),
    ("MLflow open on every port", lambda r, m: one(m, "NetworkPolicy")["spec"]["ingress"][0].pop("ports"),
     "on port 5000 only"),
    ("no NetworkPolicy for Ray", lambda r, m: r.remove(next(d for d in r if d["metadata"]["name"] == "qed-ray")),
     "the Ray pods need an Ingress"),
    ("Ray open to everyone", lambda r, m: next(d for d in r if d["metadata"]["name"] == "qed-ray")["spec"].update(
        ingress=[{}]), "the Ray pods need"),
    ("MLflow without auth", lambda r, m: _mlflow(m)["containers"][0].update(
        args=[a.replace("--app-name basic-auth", "") for a in _mlflow(m)["containers"][0]["args"]]),
     "`--app-name basic-auth`"),
    ("store URI in argv", lambda r, m: _mlflow(m)["containers"][0].update(
        args=[a + " --backend-store-uri=$(MLFLOW_BACKEND_STORE_URI)" for a in _mlflow(m)["containers"][0]["args"]]),
     "database password in argv"),
    ("admin password a literal", lambda r, m: _mlflow(m)["containers"][0]["env"].__setitem__(
        2, {"name": "MLFLOW_AUTH_ADMIN_PASSWORD", "value": "hunter22"}), "MLFLOW_AUTH_ADMIN_PASSWORD is a literal"),
    ("clients without credentials", lambda r, m: _worker(r)["containers"][0].update(
        env=[e for e in _worker(r)["containers"][0]["env"] if not e["name"].startswith("MLFLOW_TRACKING_U")]),
     "gpu: MLFLOW_TRACKING_USERNAME/PASSWORD"),
]
KUBE_CHECKS = (service_account_problems, security_context_problems, network_policy_problems, mlflow_auth_problems)


def kube_problems(ray_docs, mlflow_docs) -> list[str]:
    return [p for check in KUBE_CHECKS for p in check(ray_docs, mlflow_docs)]


@pytest.mark.parametrize("name,mutate,message", KUBE_BROKEN, ids=[b[0] for b in KUBE_BROKEN])
def test_kuberay_trust_rules(name, mutate, message):
    ray_docs, mlflow_docs = copy.deepcopy(load_docs(ROOT / KUBERAY)), copy.deepcopy(load_docs(ROOT / KUBERAY_MLFLOW))
    assert kube_problems(ray_docs, mlflow_docs) == []
    mutate(ray_docs, mlflow_docs)
    problems = kube_problems(ray_docs, mlflow_docs)
    assert any(message in p for p in problems), problems


# ---- image supply chain and upload filters ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recipe() -> dict[str, str]:
    return {n: (ROOT / "docker" / n).read_text() for n in ("Dockerfile", "constraints.txt", "smoke.sh")}


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["constraints.txt"].replace("numpy==2.4.6\n", ""), "numpy is installed but not pinned"),
    (lambda r: r["constraints.txt"].replace("boto3==1.44.5", "boto3>=1.44"), "boto3 is not pinned with =="),
    (lambda r: r["constraints.txt"].replace("mlflow==3.17.2", "mlflow==3.16.0"), "mlflow==3.16.0 violates"),
    (lambda r: r["Dockerfile"].replace('pip install --no-cache-dir -c /home/ray/constraints.txt "torch',
                                       'pip install --no-cache-dir "torch', 1), "needs -c docker/constraints.txt"),
])
def test_every_pip_install_is_pinned_by_the_constraints_file(recipe, edit, message):
    pins = load_pins(ROOT)
    assert constraints_problems(recipe["Dockerfile"], recipe["constraints.txt"], pins) == []
    edited = edit(recipe)
    is_dockerfile = edited.startswith("# syntax")
    problems = constraints_problems(edited if is_dockerfile else recipe["Dockerfile"],
                                    recipe["constraints.txt"] if is_dockerfile else edited, pins)
    assert any(message in p for p in problems), problems


def test_passwordless_sudo_is_removed_and_checked(recipe):
    assert sudo_problems(recipe["Dockerfile"], recipe["smoke.sh"]) == []
    no_sed = recipe["Dockerfile"].replace("RUN sed -i '/NOPASSWD/d' /etc/sudoers", "RUN true")
    assert sudo_problems(no_sed, recipe["smoke.sh"]) == [
        "the Dockerfile must remove the base image's NOPASSWD sudo rule (/etc/sudoers)"]
    assert sudo_problems(recipe["Dockerfile"], "set -e\n") == ["docker/smoke.sh must fail when `sudo -n true` succeeds"]


def test_smoke_script_refuses_an_image_with_passwordless_sudo(tmp_path):
    """docker/smoke.sh's sudo step, run with a stub `sudo` that lets anyone in, and with one that asks for a
    password."""
    script = (ROOT / "docker" / "smoke.sh").read_text()
    step = script[script.index("if command -v sudo"):script.index("fi\n", script.index("if command -v sudo")) + 3]
    for name, body, rc in (("open", "exit 0", 1), ("closed", "exit 1", 0)):
        bin_dir = tmp_path / name
        bin_dir.mkdir()
        (bin_dir / "sudo").write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / "sudo").chmod(0o755)
        proc = subprocess.run(["bash", "-c", f"set -euo pipefail\n{step}"], capture_output=True, text=True,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
        assert proc.returncode == rc, (name, proc.stderr)


def test_ignore_files_list_every_secret_pattern():
    rayignore, dockerignore = (ROOT / ".rayignore").read_text(), (ROOT / ".dockerignore").read_text()
    assert ignore_problems(rayignore, dockerignore) == []
    assert ignore_problems(rayignore.replace("*.key\n", ""), dockerignore) == [
        ".rayignore: secrets not excluded: ['*.key']"]
    assert ignore_problems(rayignore, dockerignore.replace("**/.aws/\n", "")) == [
        ".dockerignore: secrets not excluded: ['.aws/']"]
    # Local state stays out of both too, and the build context keeps docker/ (smoke.sh, constraints.txt).
    for text in (rayignore, dockerignore):
        patterns = {ln.strip().rstrip("/") for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}
        assert {".git", ".venv", "results", "mlruns", "*.db"} <= patterns
        assert not {"docker", "cluster", "qed_ray", "sweeps"} & patterns


SECRETS = [".env", "deploy/prod.env", "auth_token", "keys/ray.token", "id.pem", "sub/dir/server.key",
           "gcp-credentials.json", ".aws/credentials", ".config/gcloud/application_default_credentials.json",
           ".kube/config", ".ssh/id_ed25519", ".pgpass", ".qed/mlflow.env", "results/s/mlflow.db", ".git/config",
           ".netrc", "certs/client.pfx", "db-secret.yaml", "id_rsa", "keys/id_ecdsa.pub", "id_ed25519", ".pypirc",
           ".docker/config.json", ".config/qed_ray/results.key"]
CODE = ["qed_ray/__init__.py", "qed_ray/ray_token.py", "sweeps/smoke.yaml", "cluster/check.py",
        "cluster/preflight/common.py", "pyproject.toml", "docker/constraints.txt"]


def test_job_upload_leaves_secrets_behind(tmp_path):
    """Ray's own packaging of `--working-dir`, on a scratch tree with the repository's .rayignore: the code
    travels, no secret does (SECRET_PATTERNS each have a file here)."""
    from ray._private.runtime_env.packaging import create_package

    tree = tmp_path / "repo"
    for rel in SECRETS + CODE:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("x")
    shutil.copy(ROOT / ".rayignore", tree / ".rayignore")
    create_package(str(tree), tmp_path / "upload.zip", include_gitignore=True)
    with zipfile.ZipFile(tmp_path / "upload.zip") as zf:
        files = sorted(n for n in zf.namelist() if not n.endswith("/"))
    assert files == sorted(CODE + [".rayignore"])
    assert len(SECRET_PATTERNS) <= len(SECRETS)


# Stand-in for docker: `buildx imagetools inspect REF` answers a fixed digest for the base images and for pushed
# tags (a file per pushed tag), `buildx build ... --push` records its arguments.
DOCKER_STUB = r"""#!/bin/bash
ref_file() { echo "$STATE/pushed-$(echo "$1" | tr '/:@' '___')"; }
if [[ "$1 $2 $3" == "buildx imagetools inspect" ]]; then
  case "$4" in
    rayproject/ray:*) echo "\"sha256:$(printf 'b%.0s' {1..64})\"" ;;
    *) [[ -e "$(ref_file "$4")" ]] || exit 1; echo "\"sha256:$(printf 'c%.0s' {1..64})\"" ;;
  esac
elif [[ "$1 $2" == "buildx build" ]]; then
  echo "$*" >> "$STATE/builds"
  for ((i = 1; i <= $#; i++)); do
    if [[ "${!i}" == -t ]]; then j=$((i + 1)); : > "$(ref_file "${!j}")"; fi
  done
else
  exit 2
fi
"""


def test_build_script_pins_the_base_by_digest_records_the_push_and_never_repushes(tmp_path):
    work = tmp_path / "repo"
    (work / "docker").mkdir(parents=True)
    shutil.copy(ROOT / "docker" / "build.sh", work / "docker" / "build.sh")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text(DOCKER_STUB)
    (tmp_path / "bin" / "docker").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "STATE": str(tmp_path), "REGISTRY": "reg.example/org"}
    run = lambda *args: subprocess.run(["bash", "docker/build.sh", *args], cwd=work, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=60)
    first = run()
    assert first.returncode == 0, first.stderr
    base, pushed = "sha256:" + "b" * 64, "sha256:" + "c" * 64
    assert (work / "docker" / "images.lock").read_text().splitlines() == [
        f"reg.example/org/qed-ray:2.60.0-py311-gpu@{pushed}  base=rayproject/ray:2.60.0-py311-gpu@{base}",
        f"reg.example/org/qed-ray:2.60.0-py311-cpu@{pushed}  base=rayproject/ray:2.60.0-py311-cpu@{base}"]
    builds = (tmp_path / "builds").read_text().splitlines()
    assert f"BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu@{base}" in builds[0] and "--push" in builds[0]
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in builds[1]
    again = run("gpu")  # the tag exists now: refused, nothing built
    assert again.returncode == 1 and "already exists in the registry" in again.stderr
    assert len((tmp_path / "builds").read_text().splitlines()) == 2
    assert run("arm").returncode == 2
