"""Trust boundaries of the VM clusters (cluster/aws.yaml, cluster/gcp.yaml) and the cloud files beside them.

Who may reach what: the nodes' network is closed to everything but the cluster itself and SSH from an admin range;
the GPU workers, where trial code runs, get no cloud rights (read-only image pull at most); the head gets what the
autoscaler and the MLflow artifact proxy need; the shared file system admits the cluster's nodes only (TLS + IAM on
EFS; subnets on Filestore), root-squashed on the workers; MLflow needs a login, and no secret is written into a
config file or a command line.
"""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path

import yaml

from .common import (MLFLOW_ADMIN_ENV, MLFLOW_CLIENT_ENV, MLFLOW_USERS_TOOL, STORAGE_PATH,
                     command_flags)
from .launcher import all_shell_commands, nfs_mounts, node_init_commands, worker_types
from .trust_iam import aws_head_scope_problems

RAY_DEFAULT_AWS_PROFILE = "ray-autoscaler-v1"  # EC2FullAccess + S3FullAccess
RAY_DEFAULT_GCP_ACCOUNT = "ray-autoscaler-sa-v1"  # compute.admin, storage.objectAdmin, iam.serviceAccountUser
WORKER_PULL_ACTIONS = {"ecr:GetAuthorizationToken", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
                       "ecr:BatchCheckLayerAvailability"}
HEAD_EC2_ACTIONS = {"ec2:RunInstances", "ec2:CreateTags", "ec2:TerminateInstances", "ec2:DescribeInstances",
                    "ec2:DescribeInstanceTypes", "ec2:DescribeImages", "ec2:DescribeSubnets"}
HEAD_S3_ACTIONS = {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
WORKER_SCOPES = {"https://www.googleapis.com/auth/devstorage.read_only"}
# NAME=value where the value is neither a variable ($...) nor generated in place (a Python f-string field {...}).
SECRET_NAME = re.compile(r"\b([A-Z][A-Z0-9_]*(?:PASSWORD|TOKEN|SECRET)[A-Z0-9_]*)=(?![\"']?[$\{])")


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def allow_statements(policy: dict) -> list[tuple[list[str], list[str], dict]]:
    """(actions, resources, condition) of each Allow statement of an IAM policy document."""
    return [(_listed(s.get("Action", [])), _listed(s.get("Resource", [])), s.get("Condition", {}))
            for s in _listed(policy.get("Statement", [])) if s.get("Effect") == "Allow"]


def worker_policy_problems(role: str, policy: dict) -> list[str]:
    """A worker role may pull images (read-only) and nothing else."""
    return [f"{role}: workers run trial code and may not be allowed {action} (read-only image pull at most)"
            for actions, _, _ in allow_statements(policy) for action in actions if action not in WORKER_PULL_ACTIONS]


def _head_action_problems(role: str, action: str, resources: list[str], workers: set[str]):
    if "*" in action:
        return [f"{role}: wildcard action {action!r}; list the actions the autoscaler and MLflow use"]
    if action in HEAD_EC2_ACTIONS:  # which instances they reach: trust_iam.aws_head_scope_problems
        return []
    if action == "iam:PassRole":
        passed = {r.rsplit(":role/", 1)[-1] for r in resources if ":role/" in r}
        if len(passed) != len(resources) or not passed <= workers:
            return [f"{role}: iam:PassRole only on the workers' role {sorted(workers)}, got {resources}"]
        return []
    if action in HEAD_S3_ACTIONS:
        bad = [r for r in resources if not r.startswith("arn:aws:s3:::") or r.startswith("arn:aws:s3:::*")
               or (action != "s3:ListBucket" and "/" not in r)]
        return [f"{role}: {action} only on the MLflow artifact prefix, got {bad}"] if bad else []
    return [f"{role}: {action} is needed neither by the autoscaler nor by the MLflow server"]


def head_policy_problems(role: str, policy: dict, workers: set[str]) -> list[str]:
    """The head's role: the autoscaler's EC2 calls, PassRole of the workers' role, the artifact prefix."""
    return [p for actions, resources, _ in allow_statements(policy) for action in actions
            for p in _head_action_problems(role, action, resources, workers)]


def efs_policy_problems(policy: dict, head: str, workers: set[str]) -> list[str]:
    """The EFS file system policy: TLS only, the cluster's roles only, root for the head only."""
    problems = []
    statements = _listed(policy.get("Statement", []))
    tls_denials = [json.dumps(s.get("Condition", {})) for s in statements if s.get("Effect") == "Deny"]
    if not any("aws:SecureTransport" in c and "false" in c for c in tls_denials):
        problems.append("EFS policy: deny requests without TLS (aws:SecureTransport false)")
    for s in statements:
        if s.get("Effect") != "Allow":
            continue
        principals = _listed((s.get("Principal") or {}).get("AWS", "*") if isinstance(s.get("Principal"), dict)
                             else s.get("Principal", "*"))
        roles = {p.rsplit(":role/", 1)[-1] if ":role/" in p else "*" for p in principals}
        if not roles <= {head} | workers:
            problems.append(f"EFS policy: allows {sorted(roles - {head} - workers)}; only the cluster's roles")
        if "elasticfilesystem:ClientRootAccess" in _listed(s.get("Action", [])) and roles != {head}:
            problems.append(f"EFS policy: root access for {sorted(roles)}; only the head keeps root (workers are "
                            f"root-squashed)")
    return problems


def _profile(node_config: dict) -> str | None:
    arn = (node_config.get("IamInstanceProfile") or {}).get("Arn", "")
    return arn.rsplit("instance-profile/", 1)[-1] if arn else None


def aws_node_problems(cfg: dict) -> list[str]:
    """Every node in the pre-created security group, IMDSv2 with hop limit 1, EFS mounted over TLS + IAM."""
    problems = []
    for name, t in cfg["available_node_types"].items():
        nc = t.get("node_config", {})
        if not nc.get("SecurityGroupIds"):
            problems.append(f"{name}: SecurityGroupIds must name the pre-created node group (Ray's default "
                            f"group opens SSH to 0.0.0.0/0)")
        md = nc.get("MetadataOptions", {})
        if md.get("HttpTokens") != "required" or md.get("HttpPutResponseHopLimit") != 1:
            problems.append(f"{name}: MetadataOptions must require IMDSv2 tokens with hop limit 1")
    for name, cmds in node_init_commands(cfg).items():
        for fstype, options, _, _ in nfs_mounts(cmds).values():
            if fstype != "efs" or not {"tls", "iam"} <= set(options.split(",")):
                problems.append(f"{name}: mount the shared file system with `mount -t efs -o tls,iam`")
    return problems


def aws_trust_problems(cfg: dict, iam_dir: Path) -> list[str]:
    """Network, metadata service, instance roles and EFS policy of cluster/aws.yaml."""
    problems = aws_node_problems(cfg)
    head = _profile(cfg["available_node_types"][cfg["head_node_type"]]["node_config"])
    workers = {w for _, t in worker_types(cfg) if (w := _profile(t.get("node_config", {})))}
    if head in (None, RAY_DEFAULT_AWS_PROFILE) or not (iam_dir / f"aws-{head}.json").exists():
        problems.append(f"head: IamInstanceProfile must be the project's head role with its policy in "
                        f"{iam_dir.name}/aws-<role>.json (not Ray's {RAY_DEFAULT_AWS_PROFILE}), got {head!r}")
    else:
        policy = json.loads((iam_dir / f"aws-{head}.json").read_text())
        types = {t.get("node_config", {}).get("InstanceType") for _, t in worker_types(cfg)}
        problems += head_policy_problems(head, policy, workers)
        problems += aws_head_scope_problems(head, policy, cfg.get("cluster_name", ""), types - {None})
    for worker in sorted(workers):
        if worker in (head, RAY_DEFAULT_AWS_PROFILE):
            problems.append(f"workers must not use the head's or Ray's profile {worker!r}: trial code could "
                            f"launch instances and write buckets")
        elif (iam_dir / f"aws-{worker}.json").exists():
            problems += worker_policy_problems(worker, json.loads((iam_dir / f"aws-{worker}.json").read_text()))
    efs = iam_dir / "aws-efs-policy.json"
    problems += (efs_policy_problems(json.loads(efs.read_text()), head or "", workers) if efs.exists()
                 else [f"{efs.name}: the EFS file system policy is missing"])
    return problems


def filestore_problems(flags: dict) -> list[str]:
    """Filestore export options: private subnets only, root kept by one small (head) range, squashed elsewhere."""
    rules = (flags.get("--file-share") or {}).get("nfs-export-options") or []
    if not rules:
        return ["Filestore flags: no nfs-export-options (the share would be open to the whole network)"]
    problems, ranges, rooted = [], [], []
    for rule in rules:
        nets = [ipaddress.ip_network(r) for r in rule.get("ip-ranges", [])]
        if not nets or any(not n.is_private or n.prefixlen < 16 for n in nets):
            problems.append(f"Filestore flags: ip-ranges {rule.get('ip-ranges')} must be the cluster's private "
                            f"subnets (/16 or smaller)")
        ranges += nets
        if rule.get("squash-mode") == "NO_ROOT_SQUASH":
            rooted += nets
        elif rule.get("squash-mode") != "ROOT_SQUASH":
            problems.append(f"Filestore flags: {rule.get('ip-ranges')} must be ROOT_SQUASH")
    if len(rooted) > 1 or any(n.prefixlen < 28 for n in rooted):
        problems.append(f"Filestore flags: root is kept only by the head's subnet (one range, /28 or smaller), "
                        f"got {[str(n) for n in rooted]}")
    if any(a.overlaps(b) for i, a in enumerate(ranges) for b in ranges[i + 1:]):
        problems.append("Filestore flags: ip-ranges overlap")
    return problems


def _gcp_account(node_config: dict) -> tuple[str | None, set[str]]:
    accounts = node_config.get("serviceAccounts") or []
    email = accounts[0].get("email") if accounts else None
    return (email.split("@")[0] if email else None), {s for a in accounts for s in a.get("scopes", [])}


def gcp_network_problems(cfg: dict) -> list[str]:
    """Every node in the cluster's own network (never `default`), with the tag the firewall rules select."""
    problems, tags = [], []
    for name, t in cfg["available_node_types"].items():
        nc = t.get("node_config", {})
        nets = nc.get("networkInterfaces") or []
        where = [str(n.get("subnetwork", "")) + " " + str(n.get("network", "")) for n in nets]
        if not nets or any(re.search(r"(^|/)default(\s|$)", w.strip()) for w in where):
            problems.append(f"{name}: networkInterfaces must put the node in the cluster's own subnetwork, never the "
                            f"`default` network (its default-allow-internal rule opens every port)")
        tags.append(set((nc.get("tags") or {}).get("items", [])))
    if not set.intersection(*tags):
        problems.append("node types need a common network tag (the firewall rules select the cluster by tag)")
    return problems


def gcp_trust_problems(cfg: dict, iam_dir: Path, filestore: dict) -> list[str]:
    """Network, service accounts, head role and Filestore exports of cluster/gcp.yaml."""
    problems = gcp_network_problems(cfg)
    head, _ = _gcp_account(cfg["available_node_types"][cfg["head_node_type"]]["node_config"])
    role_file = iam_dir / f"gcp-{head}.yaml"
    if head in (None, RAY_DEFAULT_GCP_ACCOUNT) or not role_file.exists():
        problems.append(f"head: serviceAccounts must be the project's head account with its role in "
                        f"{iam_dir.name}/gcp-<account>.yaml (not Ray's {RAY_DEFAULT_GCP_ACCOUNT}), got {head!r}")
    else:
        for perm in yaml.safe_load(role_file.read_text()).get("includedPermissions", []):
            if not perm.startswith("compute.") or "*" in perm:
                problems.append(f"{role_file.name}: {perm} is not needed by the autoscaler (compute only)")
    for name, t in worker_types(cfg):
        account, scopes = _gcp_account(t.get("node_config", {}))
        if account is not None and (account in (head, RAY_DEFAULT_GCP_ACCOUNT) or not scopes <= WORKER_SCOPES):
            problems.append(f"{name}: workers run trial code; no service account, or one with the "
                            f"devstorage.read_only scope at most (got {account}: {sorted(scopes)})")
    return problems + filestore_problems(filestore)


def vm_secret_problems(cfg: dict) -> list[str]:
    """Tokens and MLflow credentials travel as owner-only files, never as literals; the sweeps folder is closed."""
    problems, text = [], "\n".join(all_shell_commands(cfg))
    mounts = cfg.get("file_mounts", {})
    for path in ("~/.ray/auth_token", "~/.qed/mlflow.env"):
        if path not in mounts:
            problems.append(f"file_mounts must copy {path} to every node")
        if not re.search(rf"chmod\s+600\s+[^&;]*{re.escape(path)}", " ".join(cfg.get("setup_commands", []))):
            problems.append(f"setup_commands must chmod 600 {path}")
    if not re.search(r"\.\s+~/\.qed/mlflow\.env", " ".join(cfg.get("setup_commands", []))):
        problems.append("~/qed_env.sh must export the MLflow credentials from ~/.qed/mlflow.env")
    for name in sorted(set(SECRET_NAME.findall(text))):
        problems.append(f"{name} is set to a literal in the config; secrets come from owner-only files")
    head_init = " ".join(node_init_commands(cfg)[cfg["head_node_type"]])
    if not re.search(rf"chmod\s+7[05]0\s+{re.escape(str(STORAGE_PATH))}", head_init):
        problems.append(f"head: {STORAGE_PATH} must be closed to other users (chmod 750): the sweep folder must "
                        f"be writable only by the cluster")
    return problems


def vm_mlflow_problems(cfg: dict) -> list[str]:
    """The head's MLflow server: basic auth, no store URI in argv, an admin login of its own (generated on the head
    into an owner-only file no other node or client environment sees), and the nodes' non-admin clients' user
    created by cluster/mlflow_users.py."""
    text = " ".join(cfg.get("head_start_ray_commands", []))
    flags = command_flags(text, ("mlflow", "server")) or {}
    problems = []
    if flags.get("app-name") != "basic-auth":
        problems.append("the MLflow server must run `--app-name basic-auth` (anonymous clients get 401)")
    if "backend-store-uri" in flags:
        problems.append("--backend-store-uri puts the store URI in argv; set MLFLOW_BACKEND_STORE_URI instead")
    if not re.search(r"\bMLFLOW_AUTH_CONFIG_PATH=[\"']?\$", text):
        problems.append("the MLflow server's environment must set MLFLOW_AUTH_CONFIG_PATH from a variable")
    admin = re.escape(MLFLOW_ADMIN_ENV)
    if re.search(r"MLFLOW_AUTH_ADMIN_\w+=[\"']?\$\{?MLFLOW_TRACKING_", text):
        problems.append("the MLflow admin's login is the clients' (MLFLOW_TRACKING_USERNAME/PASSWORD): every trial "
                        f"would be an admin; the server reads its own from {MLFLOW_ADMIN_ENV}")
    generated = re.search(rf"\(umask 077 && python -c '[^']*' > {admin}\)", text)
    if not generated or not re.search(rf"set -a\s*&&\s*\.\s+{admin}", text):
        problems.append(f"the MLflow server must read its admin login from {MLFLOW_ADMIN_ENV}, generated owner-only "
                        f"(umask 077) on the head")
    elsewhere = [*cfg.get("file_mounts", {}).keys(), *map(str, cfg.get("file_mounts", {}).values()),
                 *cfg.get("setup_commands", []), *cfg.get("worker_start_ray_commands", [])]
    if any("admin.env" in item for item in elsewhere):
        problems.append(f"{MLFLOW_ADMIN_ENV} must stay on the head, out of file_mounts and of the nodes' environment")
    users = [c for c in cfg.get("head_start_ray_commands", []) if MLFLOW_USERS_TOOL in c]
    if not users or f"--admin-env {MLFLOW_ADMIN_ENV}" not in users[0] or f"--client-env {MLFLOW_CLIENT_ENV}" \
            not in users[0]:
        problems.append(f"head_start_ray_commands must create the clients' user: python {MLFLOW_USERS_TOOL} "
                        f"--admin-env {MLFLOW_ADMIN_ENV} --client-env {MLFLOW_CLIENT_ENV}")
    return problems
