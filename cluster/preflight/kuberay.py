"""KubeRay manifests (cluster/kuberay.yaml, cluster/kuberay-mlflow.yaml): the RayCluster, its shared volume and the
MLflow server's wiring (trust boundaries: trust.py)."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import ray

from .common import RAY_UID, SHARED_MOUNT, Pins, command_flags, is_under, one


def pod_specs(cr: dict) -> list[tuple[str, dict]]:
    """(group name, pod spec) of the head group and each worker group."""
    spec = cr.get("spec", {})
    groups = [("head", spec.get("headGroupSpec", {}))] + [
        (g.get("groupName", "?"), g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, group.get("template", {}).get("spec", {})) for name, group in groups]


def ray_containers(cr: dict) -> list[tuple[str, dict, dict]]:
    """(group name, container, pod spec) of the Ray container of the head and each worker group."""
    return [(name, pod["containers"][0], pod) for name, pod in pod_specs(cr) if pod.get("containers")]


def env_values(container: dict) -> dict[str, str | None]:
    """Literal env values of a container (None for valueFrom entries)."""
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def storage_claim(container: dict, pod: dict, storage: str) -> tuple[str, str, str] | None:
    """(claimName, mountPath, subPath) of the PVC volume that holds `storage` in this container, if any."""
    claims = {v["name"]: v["persistentVolumeClaim"].get("claimName")
              for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    mounts = [m for m in container.get("volumeMounts", []) if is_under(storage, m.get("mountPath", "-"))]
    if not mounts:
        return None
    mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the innermost mount is what the path lands on
    if mount.get("name") not in claims:
        return None
    return claims[mount["name"]], mount["mountPath"], mount.get("subPath", "")


def _claim_problems(claim_name: str, pvc: dict | None, ns: str | None) -> list[str]:
    if not pvc or pvc["metadata"].get("name") != claim_name:
        return [f"PersistentVolumeClaim {claim_name!r} is not defined in kuberay.yaml"]
    problems = []
    if pvc["metadata"].get("namespace") != ns:
        problems.append(f"PersistentVolumeClaim {claim_name!r} must be in the RayCluster's namespace {ns!r}")
    spec = pvc.get("spec", {})
    if "ReadWriteMany" not in spec.get("accessModes", []):
        problems.append(f"PersistentVolumeClaim {claim_name!r} must be ReadWriteMany (pods on several nodes)")
    if not spec.get("storageClassName"):
        problems.append(f"PersistentVolumeClaim {claim_name!r} needs a storageClassName (EFS / Filestore CSI); "
                        f"the default class is usually ReadWriteOnce block storage")
    if not spec.get("resources", {}).get("requests", {}).get("storage"):
        problems.append(f"PersistentVolumeClaim {claim_name!r} needs resources.requests.storage")
    return problems


def _init_container_ok(head: dict, claim: tuple[str, str, str], storage: str) -> bool:
    for init in head.get("initContainers", []):
        shell = " ".join(init.get("command", []) + init.get("args", []))
        if (init.get("securityContext", {}).get("runAsUser") == 0
                and storage_claim(init, head, storage) == claim
                and f"mkdir -p {storage}" in shell
                and re.search(rf"chmod\s+7[05]0\s+{re.escape(storage)}\b", shell) is not None
                and re.search(rf"chown\s+{RAY_UID}(:\d+)?\s+{re.escape(storage)}\b", shell) is not None):
            return True
    return False


def shared_volume_problems(cr: dict, docs: list[dict]) -> list[str]:
    """The head and every worker group keep QED_STORAGE_PATH on one ReadWriteMany claim of this manifest, mounted at
    the same path, and a root init container hands the sweeps folder to the ray user before Ray starts."""
    problems, seen = [], {}
    for name, container, pod in ray_containers(cr):
        storage = env_values(container).get("QED_STORAGE_PATH") or ""
        claim = storage_claim(container, pod, storage) if is_under(storage, SHARED_MOUNT) else None
        if claim is None:
            problems.append(f"{name}: does not keep QED_STORAGE_PATH {storage!r} on a mounted PersistentVolumeClaim")
        else:
            seen[name] = (*claim, storage)
    if len(set(seen.values())) > 1:
        problems.append(f"head and worker pods must mount the same claim at the same path: {seen}")
    ns = cr.get("metadata", {}).get("namespace")
    for claim_name in {c[0] for c in seen.values()}:
        problems += _claim_problems(claim_name, one(docs, "PersistentVolumeClaim"), ns)
    if "head" in seen:
        claim_name, mount_path, sub_path, storage = seen["head"]
        if not _init_container_ok(dict(pod_specs(cr))["head"], (claim_name, mount_path, sub_path), storage):
            problems.append(f"head: needs an initContainer (runAsUser 0, same volume) that creates {storage} "
                            f"owned by uid {RAY_UID} and closed to other users (chmod 750): a fresh volume's root "
                            f"belongs to root, and the sweep folder must be writable only by the cluster")
    return problems


def _cluster_problems(cr: dict, pins: Pins) -> list[str]:
    problems, spec = [], cr.get("spec", {})
    if cr.get("apiVersion") != "ray.io/v1":
        problems.append(f"apiVersion must be ray.io/v1, got {cr.get('apiVersion')!r}")
    if cr.get("kind") != "RayCluster":
        problems.append("kind must be RayCluster")
    if not cr.get("metadata", {}).get("namespace"):
        problems.append("metadata.namespace must be set (the autoscaler config derivation needs it)")
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append("enableInTreeAutoscaling must be true")
    if not isinstance(spec.get("autoscalerOptions"), dict):
        problems.append("autoscalerOptions must be set")
    ray_version = str(spec.get("rayVersion", ""))
    if not ray_version.startswith(pins.ray_series + "."):
        problems.append(f"rayVersion {ray_version!r} is outside the pinned series {pins.ray_series}")
    if ray_version != ray.__version__:
        problems.append(f"rayVersion {ray_version!r} != installed ray {ray.__version__}")
    if str(spec.get("headGroupSpec", {}).get("rayStartParams", {}).get("num-cpus")) != "0":
        problems.append("headGroupSpec.rayStartParams num-cpus must be \"0\" (no trials on the head)")
    return problems


def _worker_group_problems(cr: dict) -> list[str]:
    problems, gpu_groups = [], 0
    for group in cr.get("spec", {}).get("workerGroupSpecs", []):
        name = group.get("groupName", "?")
        lo, hi = group.get("minReplicas"), group.get("maxReplicas")
        if not isinstance(lo, int) or not isinstance(hi, int) or lo > hi:
            problems.append(f"{name}: minReplicas ({lo}) must be <= maxReplicas ({hi})")
        pod = group.get("template", {}).get("spec", {})
        limits = (pod.get("containers") or [{}])[0].get("resources", {}).get("limits", {})
        if int(limits.get("nvidia.com/gpu", 0)) >= 1:
            gpu_groups += 1
            if lo != 0:
                problems.append(f"{name}: a GPU group should scale from minReplicas 0")
            if not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])):
                problems.append(f"{name}: GPU group needs a nvidia.com/gpu toleration")
    if gpu_groups == 0:
        problems.append("no worker group with limits nvidia.com/gpu >= 1")
    return problems


def _container_problems(cr: dict) -> list[str]:
    problems, ray_version = [], str(cr.get("spec", {}).get("rayVersion", ""))
    for name, container, pod in ray_containers(cr):
        tag = container.get("image", "").split("@")[0].rsplit(":", 1)[-1]
        if not tag.startswith(ray_version + "-"):
            problems.append(f"{name}: image tag {tag!r} does not match rayVersion {ray_version!r}")
        env = env_values(container)
        if env.get("MUJOCO_GL") != "egl":
            problems.append(f"{name}: env MUJOCO_GL must be egl")
        if not ({"graphics", "all"} & set((env.get("NVIDIA_DRIVER_CAPABILITIES") or "").split(","))):
            problems.append(f"{name}: env NVIDIA_DRIVER_CAPABILITIES must include graphics")
        if not (env.get("MLFLOW_TRACKING_URI") or "").startswith("http://"):
            problems.append(f"{name}: env MLFLOW_TRACKING_URI must point at the MLflow service")
        storage = env.get("QED_STORAGE_PATH") or ""
        if not is_under(storage, SHARED_MOUNT):
            problems.append(f"{name}: env QED_STORAGE_PATH must be a path under {SHARED_MOUNT} (the shared volume; "
                            f"the sweep refuses s3:// and gs:// URIs), got {storage!r}")
        elif storage_claim(container, pod, storage) is None:
            problems.append(f"{name}: env QED_STORAGE_PATH {storage} is not on a persistentVolumeClaim volume "
                            f"mounted in this pod")
        shm = {v["name"] for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"}
        mounts = container.get("volumeMounts", [])
        if not any(m.get("mountPath") == "/dev/shm" and m.get("name") in shm for m in mounts):
            problems.append(f"{name}: /dev/shm must be a Memory emptyDir")
    return problems


def check_kuberay(cr: dict, pins: Pins) -> list[str]:
    """Project requirements on the RayCluster CR (KubeRay ships no schema in the Ray wheel)."""
    return _cluster_problems(cr, pins) + _worker_group_problems(cr) + _container_problems(cr)


def mlflow_container(manifests: list[dict]) -> dict:
    """The MLflow Deployment's container."""
    return one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def mlflow_flags(container: dict) -> dict:
    """The options the container passes to `mlflow server` (from its command + args, a shell script or a list)."""
    words = container.get("command", []) + container.get("args", [])
    text = " ".join(words)
    return command_flags(text, ("mlflow", "server")) or {}


def mlflow_reachability_problems(cr: dict, manifests: list[dict]) -> list[str]:
    """Can every Ray pod reach the MLflow server at its MLFLOW_TRACKING_URI?"""
    from mlflow.server.security_utils import is_allowed_host_header

    svc, dep = one(manifests, "Service"), one(manifests, "Deployment")
    if not svc or not dep:
        return ["kuberay-mlflow.yaml needs one Deployment and one Service"]
    problems = []
    pod_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    if not svc["spec"].get("selector") or svc["spec"]["selector"].items() - pod_labels.items():
        problems.append("Service selector does not match the Deployment's pod labels")
    ns = cr["metadata"].get("namespace")
    for obj in (svc, dep):
        if obj["metadata"].get("namespace") != ns:
            problems.append(f"{obj['kind']} must be in the RayCluster's namespace {ns!r}")
    port = svc["spec"]["ports"][0]["port"]
    flags = mlflow_flags(mlflow_container(manifests))
    allowed = [h.strip() for h in str(flags.get("allowed-hosts", "")).split(",") if h.strip()]
    expected_host = f"{svc['metadata']['name']}.{ns}.svc.cluster.local"
    for name, container, _ in ray_containers(cr):
        uri = urlparse(env_values(container).get("MLFLOW_TRACKING_URI") or "")
        if uri.hostname != expected_host or uri.port != port:
            problems.append(f"{name}: MLFLOW_TRACKING_URI {uri.geturl()!r} is not the Service "
                            f"http://{expected_host}:{port}")
        # MLflow 3 rejects unknown Host headers; the pods send "<host>:<port>".
        if not allowed or not is_allowed_host_header(allowed, uri.netloc):
            problems.append(f"{name}: MLflow --allowed-hosts rejects Host {uri.netloc!r}")
    if not is_allowed_host_header(allowed or ["-"], "localhost:5000"):
        problems.append("MLflow --allowed-hosts rejects localhost (kubectl port-forward)")
    if flags.get("port") is not None and str(flags.get("port")) != str(port):
        problems.append(f"MLflow listens on {flags.get('port')}, Service targets {port}")
    if flags.get("host") != "0.0.0.0":
        problems.append("MLflow must bind 0.0.0.0 to be reachable through the Service")
    if not re.match(r"(s3|gs)://", str(flags.get("artifacts-destination", ""))):
        problems.append("MLflow --artifacts-destination must be an object store (s3:// or gs://)")
    return problems
