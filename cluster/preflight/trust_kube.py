"""Trust boundaries of the KubeRay manifests (cluster/kuberay.yaml, cluster/kuberay-mlflow.yaml,
cluster/kuberay-namespace.yaml).

Separate ServiceAccounts (only the head's autoscaler sidecar, which patches the RayCluster, holds an API token; only
MLflow carries the bucket identity), a restricted securityContext on every container, a Pod Security Admission level
on the namespace, NetworkPolicies that admit the Ray and MLflow ports only from the Ray pods and keep the Ray pods
away from the cloud metadata endpoint, ClusterIP Services only, Ray's token auth, and MLflow behind basic auth with
every credential from a Secret: the admin's for the server alone, a non-admin user's for the Ray pods.
"""

from __future__ import annotations

import ipaddress

from .common import of_kind, one
from .kuberay import mlflow_container, mlflow_flags, pod_specs

CLOUD_IDENTITY = ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account")
SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "_KEY")
ALLOWED_ROOT_CAPS = {"CHOWN"}
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"  # where Ray's KubeRay node provider reads the token
# The node's cloud metadata endpoint: EC2 IMDS, the GCE / GKE metadata server, Azure IMDS; over IPv6 EC2's IMDS and
# GCE's metadata server.
METADATA_ADDRESSES = tuple(map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254", "fd20:ce::254")))
METADATA_EXCEPTS = ", ".join(f"{a}/{a.max_prefixlen}" for a in METADATA_ADDRESSES)
PSA_LEVELS = ("baseline", "restricted")
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"


def _accounts(docs: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in of_kind(docs, "ServiceAccount")}


def _mlflow_pod(mlflow_docs: list[dict]) -> dict:
    return one(mlflow_docs, "Deployment")["spec"]["template"]["spec"]


def service_account_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """Head, workers and MLflow each on their own account; no API token where nothing calls the API."""
    cr = one(ray_docs, "RayCluster")
    accounts = _accounts(ray_docs) | _accounts(mlflow_docs)
    pods = pod_specs(cr) + [("mlflow", _mlflow_pod(mlflow_docs))]
    names = {group: pod.get("serviceAccountName") for group, pod in pods}
    problems = [f"{group}: serviceAccountName {sa!r} is not defined in the manifests"
                for group, sa in names.items() if sa not in accounts]
    if len(set(names.values())) != len(names):
        problems.append(f"head, worker groups and MLflow need separate ServiceAccounts, got {names}")
    for group, pod in pods:
        sa = accounts.get(names[group], {})
        mounted = pod.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
        if mounted is not False:
            problems.append(f"{group}: automountServiceAccountToken must be false (nothing there calls the "
                            f"Kubernetes API; a token would let trial code patch the RayCluster)" if group != "head"
                            else "head: automountServiceAccountToken must be false: a pod-wide token also sits in "
                                 "ray-head, which runs the driver and every submitted job")
        identity = [k for k in (sa.get("metadata", {}).get("annotations") or {}) if k in CLOUD_IDENTITY]
        if identity and group != "mlflow":
            problems.append(f"{group}: cloud identity {identity} belongs on the MLflow account only")
    return problems


def _context_problems(where: str, ctx: dict, pod_ctx: dict, init: bool) -> list[str]:
    if not ctx:
        return [f"{where}: no securityContext"]
    problems = []
    caps = ctx.get("capabilities") or {}
    if ctx.get("allowPrivilegeEscalation") is not False or ctx.get("privileged"):
        problems.append(f"{where}: allowPrivilegeEscalation must be false (and never privileged)")
    if "ALL" not in (caps.get("drop") or []):
        problems.append(f"{where}: capabilities must drop ALL")
    as_root = ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0
    non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True
    if as_root or not non_root:
        if not (init and as_root and set(caps.get("add") or []) <= ALLOWED_ROOT_CAPS):
            problems.append(f"{where}: must run as non-root (runAsNonRoot: true); only an init container may be "
                            f"root, with CHOWN as its only capability")
    elif caps.get("add"):
        problems.append(f"{where}: adds capabilities {caps['add']}")
    return problems


def security_context_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """Every container (Ray, init, autoscaler sidecar, MLflow): no privilege escalation, no capabilities,
    non-root."""
    cr = one(ray_docs, "RayCluster")
    problems = _context_problems("autoscaler sidecar", cr["spec"].get("autoscalerOptions", {}).get(
        "securityContext") or {}, {}, init=False)
    for group, pod in pod_specs(cr) + [("mlflow", _mlflow_pod(mlflow_docs))]:
        pod_ctx = pod.get("securityContext") or {}
        for key, init in (("containers", False), ("initContainers", True)):
            for c in pod.get(key, []):
                problems += _context_problems(f"{group}/{c.get('name')}", c.get("securityContext") or {}, pod_ctx,
                                              init)
    return problems


def _admits_only(policy: dict, cluster: str) -> bool:
    """Every ingress rule of the policy admits only pods labelled ray.io/cluster=<cluster> of its namespace."""
    rules = policy.get("spec", {}).get("ingress", [])
    peers = [peer for rule in rules for peer in (rule.get("from") or [{}])]
    return all(set(peer) == {"podSelector"} and
               peer["podSelector"].get("matchLabels", {}).get("ray.io/cluster") == cluster for peer in peers)


def _selecting(policies: list[dict], labels: dict) -> list[dict]:
    return [p for p in policies if "Ingress" in p["spec"].get("policyTypes", [])
            and p["spec"].get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()]


def network_policy_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """The Ray pods and the MLflow pod each selected by an Ingress NetworkPolicy admitting only this Ray
    cluster's pods (and MLflow's on its port only)."""
    cr = one(ray_docs, "RayCluster")
    cluster = cr["metadata"]["name"]
    policies = of_kind(ray_docs, "NetworkPolicy") + of_kind(mlflow_docs, "NetworkPolicy")
    problems = []
    ray_selected = _selecting(policies, {"ray.io/cluster": cluster})
    if not ray_selected or not all(_admits_only(p, cluster) for p in ray_selected):
        problems.append(f"the Ray pods need an Ingress NetworkPolicy admitting only pods with ray.io/cluster: "
                        f"{cluster}")
    labels = one(mlflow_docs, "Deployment")["spec"]["template"]["metadata"].get("labels", {})
    ml_selected = _selecting(policies, labels)
    ports = {p.get("port") for pol in ml_selected for r in pol["spec"].get("ingress", []) for p in r.get("ports", [])}
    if not ml_selected or not all(_admits_only(p, cluster) for p in ml_selected) or ports != {5000}:
        problems.append(f"the MLflow pod needs an Ingress NetworkPolicy admitting only ray.io/cluster: {cluster} "
                        f"pods, on port 5000 only")
    return problems


def head_token_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """The head account's API token only in the autoscaler sidecar: a projected volume of the head pod mounted there
    (at the path Ray's node provider reads) and in no other container of the pod."""
    cr = one(ray_docs, "RayCluster")
    head = dict(pod_specs(cr))["head"]
    token_volumes = {v.get("name") for v in head.get("volumes", [])
                     if any("serviceAccountToken" in src for src in (v.get("projected") or {}).get("sources", []))}
    sidecar = cr["spec"].get("autoscalerOptions", {}).get("volumeMounts") or []
    problems = []
    if not any(m.get("name") in token_volumes and m.get("mountPath") == TOKEN_PATH for m in sidecar):
        problems.append(f"autoscaler sidecar: needs the head account's token, a projected serviceAccountToken volume "
                        f"of the head pod mounted at {TOKEN_PATH} (autoscalerOptions.volumeMounts)")
    for c in head.get("containers", []) + head.get("initContainers", []):
        if any(m.get("name") in token_volumes for m in c.get("volumeMounts", [])):
            problems.append(f"head/{c.get('name')}: mounts the API token; only the autoscaler sidecar may")
    return problems


def _policy_types(policy: dict) -> list[str]:
    spec = policy.get("spec", {})
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _metadata_leaks(rule: dict) -> list[str]:
    """The metadata addresses an egress rule admits ('every destination' for a rule without peers)."""
    peers = rule.get("to") or []
    if not peers:
        return ["every destination"]
    leaks = []
    for block in (peer["ipBlock"] for peer in peers if "ipBlock" in peer):
        net = ipaddress.ip_network(block.get("cidr", ""), strict=False)
        excepted = [ipaddress.ip_network(e, strict=False) for e in block.get("except") or []]
        leaks += [str(a) for a in METADATA_ADDRESSES if a.version == net.version and a in net
                  and not any(a.version == e.version and a in e for e in excepted)]
    return leaks


def metadata_egress_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """The Ray pods are selected by an Egress NetworkPolicy, and no Egress policy of these manifests admits the
    cloud metadata endpoint to them; no Ray pod uses the node's network (NetworkPolicies and the IMDS hop limit
    do not apply there)."""
    cr = one(ray_docs, "RayCluster")
    labels = {"ray.io/cluster": cr["metadata"]["name"]}
    policies = [p for p in of_kind(ray_docs, "NetworkPolicy") + of_kind(mlflow_docs, "NetworkPolicy")
                if "Egress" in _policy_types(p)
                and p["spec"].get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()]
    problems = [] if policies else [
        f"the Ray pods need an Egress NetworkPolicy that excepts the metadata endpoint "
        f"{', '.join(map(str, METADATA_ADDRESSES))} (open egress: trial code can ask it for the node's credentials)"]
    for policy in policies:
        for rule in policy["spec"].get("egress") or [{}]:
            if leaks := _metadata_leaks(rule):
                problems.append(f"NetworkPolicy {policy['metadata'].get('name')}: admits egress to {leaks}; except "
                                f"{METADATA_EXCEPTS} from its ipBlocks")
    for group, pod in pod_specs(cr):
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                problems.append(f"{group}: {key} puts the pod on the node's namespaces, past its NetworkPolicies and "
                                f"the metadata hop limit")
    return problems


def pod_security_problems(ns_docs: list[dict], ray_docs: list[dict]) -> list[str]:
    """The RayCluster's namespace is defined with a Pod Security Admission level that its pods meet."""
    ns = one(ray_docs, "RayCluster")["metadata"].get("namespace")
    found = [d for d in of_kind(ns_docs, "Namespace") if d.get("metadata", {}).get("name") == ns]
    level = ((found[0]["metadata"].get("labels") or {}) if found else {}).get(PSA_ENFORCE)
    if level not in PSA_LEVELS:
        return [f"namespace {ns!r}: needs a Pod Security level, the label {PSA_ENFORCE}: baseline (or restricted), "
                f"got {level!r}"]
    cr = one(ray_docs, "RayCluster")
    root = [c.get("name") for _, pod in pod_specs(cr) for c in pod.get("initContainers", []) + pod.get("containers", [])
            if (c.get("securityContext") or {}).get("runAsUser") == 0]
    if level == "restricted" and root:
        return [f"namespace {ns!r}: level restricted refuses the root containers {root}; use baseline"]
    return []


def service_exposure_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """Nothing is exposed outside the Kubernetes cluster: ClusterIP Services only, no Ingress."""
    cr = one(ray_docs, "RayCluster")
    head = cr["spec"].get("headGroupSpec", {})
    problems = [f"Service {svc['metadata'].get('name')}: type {svc['spec'].get('type')}; ClusterIP only (people "
                f"reach it with kubectl port-forward)" for svc in of_kind(ray_docs + mlflow_docs, "Service")
                if svc.get("spec", {}).get("type", "ClusterIP") != "ClusterIP"]
    if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
        problems.append("headGroupSpec: serviceType ClusterIP and no enableIngress (the job API runs any code)")
    return problems + [f"Ingress {d['metadata'].get('name')}: nothing is exposed outside the cluster"
                       for d in of_kind(ray_docs + mlflow_docs, "Ingress")]


def ray_token_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """Every Ray container and the autoscaler sidecar run Ray's token auth with the token from a Secret."""
    cr = one(ray_docs, "RayCluster")
    containers = [(f"{group}/{pod['containers'][0].get('name')}", pod["containers"][0])
                  for group, pod in pod_specs(cr) if pod.get("containers")]
    containers.append(("autoscaler sidecar", cr["spec"].get("autoscalerOptions") or {}))
    problems = []
    for where, container in containers:
        env = {e["name"]: e for e in container.get("env", [])}
        if (env.get("RAY_AUTH_MODE") or {}).get("value") != "token" or _from_secret(container, "RAY_AUTH_TOKEN") \
                is None:
            problems.append(f"{where}: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret (the job API runs any "
                            f"code for whoever reaches it)")
    return problems


def _from_secret(container: dict, name: str) -> str | None:
    """The Secret an env var comes from (None if it is a literal or absent)."""
    for e in container.get("env", []):
        if e["name"] == name:
            return ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
    return None


def _secret_names(node) -> set[str]:
    """Every Secret a manifest fragment refers to (env, envFrom, volumes)."""
    if isinstance(node, list):
        return set().union(*map(_secret_names, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    names = {node[k].get("name") or node[k].get("secretName") for k in ("secretKeyRef", "secretRef", "secret")
             if isinstance(node.get(k), dict)}
    return (names - {None}).union(*map(_secret_names, node.values()))


def mlflow_auth_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """MLflow runs its basic-auth app with its admin login from a Secret that no Ray pod refers to; the Ray pods log
    in as the clients' user from a Secret of their own; no secret is a literal env value or an argument."""
    problems, server = [], mlflow_container(mlflow_docs)
    flags = mlflow_flags(server)
    if flags.get("app-name") != "basic-auth":
        problems.append("MLflow must run `--app-name basic-auth` (anonymous clients get 401)")
    if "backend-store-uri" in flags:
        problems.append("--backend-store-uri puts the database password in argv; MLflow reads "
                        "MLFLOW_BACKEND_STORE_URI from its environment")
    admin = {_from_secret(server, n) for n in ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD")}
    if None in admin or len(admin) != 1 or _from_secret(server, "MLFLOW_BACKEND_STORE_URI") is None:
        problems.append("MLflow: MLFLOW_AUTH_ADMIN_USERNAME/PASSWORD and MLFLOW_BACKEND_STORE_URI from Secrets")
    cr = one(ray_docs, "RayCluster")
    for group, pod in pod_specs(cr):
        client = {_from_secret(pod["containers"][0], n)
                  for n in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
        if None in client or len(client) != 1:
            problems.append(f"{group}: MLFLOW_TRACKING_USERNAME/PASSWORD must come from the clients' Secret")
    if used := sorted(_secret_names(cr) & admin - {None}):
        problems.append(f"the Ray pods use the MLflow admin's Secret {used}: every trial would be an MLflow admin; "
                        f"they log in as the clients' user (its own Secret, cluster/mlflow_users.py)")
    containers = [c for _, pod in pod_specs(cr) for c in pod.get("containers", [])] + [server]
    for c in containers:
        for e in c.get("env", []):
            if any(w in e["name"] for w in SECRET_WORDS) and "value" in e:
                problems.append(f"{c.get('name')}: {e['name']} is a literal; take it from a Secret")
    return problems
