"""Trust boundaries of the KubeRay manifests (cluster/kuberay.yaml, cluster/kuberay-mlflow.yaml).

Separate ServiceAccounts (only the head, whose autoscaler patches the RayCluster, mounts an API token; only MLflow
carries the bucket identity), a restricted securityContext on every container, NetworkPolicies that admit the Ray
and MLflow ports only from the Ray pods, MLflow behind basic auth with every credential from a Secret.
"""

from __future__ import annotations

from .common import of_kind, one
from .kuberay import mlflow_container, mlflow_flags, pod_specs

CLOUD_IDENTITY = ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account")
SECRET_WORDS = ("PASSWORD", "TOKEN", "SECRET", "_KEY")
ALLOWED_ROOT_CAPS = {"CHOWN"}


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
        if group != "head" and mounted is not False:
            problems.append(f"{group}: automountServiceAccountToken must be false (nothing there calls the "
                            f"Kubernetes API; a token would let trial code patch the RayCluster)")
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


def _from_secret(container: dict, name: str) -> str | None:
    """The Secret an env var comes from (None if it is a literal or absent)."""
    for e in container.get("env", []):
        if e["name"] == name:
            return ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
    return None


def mlflow_auth_problems(ray_docs: list[dict], mlflow_docs: list[dict]) -> list[str]:
    """MLflow runs its basic-auth app; its admin and the Ray pods' client credentials come from one Secret; no
    secret is a literal env value or a command-line argument."""
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
        if client != admin:
            problems.append(f"{group}: MLFLOW_TRACKING_USERNAME/PASSWORD must come from the MLflow admin's Secret "
                            f"{sorted(x for x in admin if x)}")
    containers = [c for _, pod in pod_specs(cr) for c in pod.get("containers", [])] + [server]
    for c in containers:
        for e in c.get("env", []):
            if any(w in e["name"] for w in SECRET_WORDS) and "value" in e:
                problems.append(f"{c.get('name')}: {e['name']} is a literal; take it from a Secret")
    return problems
