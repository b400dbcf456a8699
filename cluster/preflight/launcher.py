"""Ray cluster launcher configs (cluster/aws.yaml, cluster/gcp.yaml): Ray's own validators plus the project's layout.

Ray's validators are private APIs (``ray.autoscaler._private...``), pinned by the ``ray[tune,default]`` series in
pyproject.toml and used only here.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import PurePosixPath
from urllib.parse import urlparse

from .common import RAY_UID, SHARED_MOUNT, STORAGE_SCHEME, image_name_tag, is_under

# `mount -t nfs|nfs4|efs [-o OPTS] SOURCE TARGET`, as written in the initialization_commands.
NFS_MOUNT_RE = re.compile(r"\bmount\s+-t\s+(nfs4?|efs)\s+(?:-o\s+(\S+)\s+)?(\S+:\S*)\s+(/[^\s;)}]*)")


def ray_validate(cfg: dict) -> dict:
    """What `ray up` does offline: merge provider defaults, then schema + consistency checks."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def head_and_gpu_types(cfg: dict) -> tuple[dict, list[tuple[str, dict]]]:
    """The head node type and the (name, type) pairs of the worker types with a GPU."""
    types = cfg["available_node_types"]
    head = types.get(cfg.get("head_node_type"), {})
    gpu = [(name, t) for name, t in types.items()
           if name != cfg.get("head_node_type") and t.get("resources", {}).get("GPU", 0) >= 1]
    return head, gpu


def worker_types(cfg: dict) -> list[tuple[str, dict]]:
    """Every node type but the head's."""
    return [(n, t) for n, t in cfg["available_node_types"].items() if n != cfg.get("head_node_type")]


def env_file_values(setup_cmds: list[str]) -> dict[str, str]:
    """NAME=value pairs that the setup commands write to ~/qed_env.sh (quoted printf arguments)."""
    return dict(re.findall(r'"([A-Z][A-Z0-9_]*)=([^"]*)"', " ".join(setup_cmds)))


def nfs_mounts(cmds: list[str]) -> dict[str, tuple[str, str, str, str]]:
    """Mount target -> (type, options, source, the whole command) in a list of host commands."""
    return {m.group(4): (m.group(1), m.group(2) or "", m.group(3), cmd)
            for cmd in cmds for m in NFS_MOUNT_RE.finditer(cmd)}


def bind_mounts(opts: list[str]) -> dict[str, str]:
    """Container path -> host path of the `-v HOST:CONTAINER[:mode]` docker run options."""
    binds = {}
    for opt in opts:
        tokens = shlex.split(opt)
        values = [v for flag, v in zip(tokens, tokens[1:]) if flag in ("-v", "--volume")]
        values += [tok.split("=", 1)[1] for tok in tokens if tok.startswith("--volume=")]
        for value in values:
            host, container, *_ = value.split(":")
            binds[container.rstrip("/") or "/"] = host.rstrip("/") or "/"
    return binds


def node_init_commands(cfg: dict) -> dict[str, list[str]]:
    """The host commands each node type runs before Docker starts (a node type's own list replaces the global one)."""
    return {name: t.get("initialization_commands", cfg.get("initialization_commands", []))
            for name, t in cfg["available_node_types"].items()}


def _node_storage(cfg: dict, name: str, storage: str) -> tuple[str | None, PurePosixPath | None]:
    """(problem, host path of the storage folder) for one node type's container bind mounts."""
    role = "head" if name == cfg.get("head_node_type") else "worker"
    docker = cfg.get("docker", {})
    binds = bind_mounts(docker.get("run_options", []) + docker.get(f"{role}_run_options", []))
    inside = [c for c in binds if is_under(storage, c)]
    if not inside:
        return (f"{name}: QED_STORAGE_PATH {storage} is not on a `-v HOST:CONTAINER` bind mount of this node's "
                f"container (docker run_options / {role}_run_options)"), None
    container_dir = max(inside, key=len)
    return None, PurePosixPath(binds[container_dir]) / PurePosixPath(storage).relative_to(container_dir)


def _mount_problems(cfg: dict, name: str, provider: str, host_storage: PurePosixPath, cmds: list[str]):
    """(problems, (source, folder) shared location) of the file system mounted under ``host_storage``."""
    mounts = nfs_mounts(cmds)
    targets = [tgt for tgt in mounts if is_under(host_storage, tgt)]
    if not targets:
        return [f"{name}: no `mount -t nfs|efs` of {host_storage} in this node type's initialization_commands "
                f"(every node must mount the shared file system)"], None
    target = max(targets, key=len)
    _, _, source, cmd = mounts[target]
    problems = []
    if not re.search(rf"mountpoint\s+-q\s+{re.escape(target)}\s*\|\|", cmd):
        problems.append(f"{name}: the mount of {target} must be skipped when already mounted "
                        f"(`mountpoint -q {target} || ...`): `ray up` reruns initialization_commands")
    region = cfg.get("provider", {}).get("region", "")
    if provider == "aws" and not re.fullmatch(
            rf"fs-[\w-]+(\.efs\.{re.escape(region)}\.amazonaws\.com)?:/\S*", source):
        problems.append(f"{name}: {source} is not an EFS file system in {region}")
    return problems, (source, str(host_storage.relative_to(target)))


def shared_storage_problems(cfg: dict, provider: str) -> list[str]:
    """QED_STORAGE_PATH must be the same folder of one shared file system on every node: mounted on every node
    type's host (idempotently: `ray up` reruns it), bind-mounted into every container at the same path, created
    by the head for the container's user."""
    env = env_file_values(cfg.get("setup_commands", []))
    storage = env.get("QED_STORAGE_PATH", "")
    if not is_under(storage, SHARED_MOUNT):
        return [f"setup_commands must export QED_STORAGE_PATH under {SHARED_MOUNT} (the shared file system "
                f"mounted on every node), got {storage!r}; the sweep refuses s3:// and gs:// URIs"]
    problems, locations, head_type = [], {}, cfg.get("head_node_type")
    inits = node_init_commands(cfg)
    for name in cfg["available_node_types"]:
        problem, host_storage = _node_storage(cfg, name, storage)
        if problem:
            problems.append(problem)
            continue
        found, location = _mount_problems(cfg, name, provider, host_storage, inits[name])
        problems += found
        if location is None:
            continue
        locations[name] = (*location, storage)
        if name == head_type and not re.search(
                rf"chown\s+{RAY_UID}(:\d+)?\s+{re.escape(str(host_storage))}(\s|$|;|&)", " ; ".join(inits[name])):
            problems.append(f"{name}: initialization_commands must create {host_storage} owned by uid {RAY_UID} "
                            f"(the container's ray user writes the sweeps there)")
    if len(set(locations.values())) > 1:
        problems.append(f"node types do not share the same storage folder on the same file system: {locations}")
    return problems


def _node_type_problems(cfg: dict, provider: str) -> list[str]:
    head, gpu_types = head_and_gpu_types(cfg)
    problems = []
    if head.get("resources", {}).get("CPU") != 0:
        problems.append("head node type must advertise resources {CPU: 0} (no trials on the head)")
    if not gpu_types:
        problems.append("no worker node type with resources GPU >= 1")
    for name, t in gpu_types:
        if t.get("min_workers", 0) != 0:
            problems.append(f"{name}: min_workers must be 0 (scale GPUs from zero)")
        if not 1 <= t.get("max_workers", 0) <= cfg.get("max_workers", 0):
            problems.append(f"{name}: max_workers must be in [1, global max_workers]")
        if t.get("resources", {}).get("CPU", 0) < 1:
            problems.append(f"{name}: resources must declare CPU")
        if provider == "aws" and t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") != "spot":
            problems.append(f"{name}: InstanceMarketOptions.MarketType should be spot")
    return problems


def _docker_problems(cfg: dict, image: str) -> list[str]:
    docker = cfg.get("docker", {})
    problems = []
    if image_name_tag(str(docker.get("image"))) != image_name_tag(image):
        problems.append(f"docker.image {docker.get('image')!r} != documented image {image!r}")
    shared = docker.get("run_options", [])
    head_opts = " ".join(shared + docker.get("head_run_options", []))
    worker_opts = " ".join(shared + docker.get("worker_run_options", []))
    for needle in ("--gpus all", "-e MUJOCO_GL=egl", "--shm-size"):
        if needle not in worker_opts:
            problems.append(f"GPU worker docker options lack {needle!r}")
    caps = re.search(r"NVIDIA_DRIVER_CAPABILITIES=(\S+)", worker_opts)
    if not caps or not ({"graphics", "all"} & set(caps.group(1).split(","))):
        problems.append("GPU worker docker options need NVIDIA_DRIVER_CAPABILITIES with graphics")
    if "--gpus" in head_opts:
        problems.append("--gpus on the CPU head fails (no NVIDIA runtime there)")
    return problems


def environment_problems(cfg: dict, provider: str) -> list[str]:
    """What every node exports (MLflow URI, Ray's token auth, the artifact store) and how the head starts MLflow."""
    env = env_file_values(cfg.get("setup_commands", []))
    problems = []
    uri = urlparse(env.get("MLFLOW_TRACKING_URI", ""))
    if uri.scheme != "http" or uri.port != 5000:
        problems.append("setup_commands must export MLFLOW_TRACKING_URI=http://<head>:5000")
    if env.get("RAY_AUTH_MODE") != "token":
        problems.append("setup_commands must export RAY_AUTH_MODE=token")
    head_start = " ".join(cfg.get("head_start_ray_commands", []))
    if "mlflow server" not in head_start or "--port 5000" not in head_start:
        problems.append("head_start_ray_commands must start `mlflow server` on port 5000")
    if "--artifacts-destination" not in head_start:
        problems.append("the MLflow server needs --artifacts-destination (object store)")
    scheme = STORAGE_SCHEME[provider]
    if not env.get("QED_MLFLOW_ARTIFACTS", "").startswith(f"{scheme}://"):
        problems.append(f"QED_MLFLOW_ARTIFACTS must be a {scheme}:// URI")
    for key, needle in (("head_start_ray_commands", "ray start --head"),
                        ("worker_start_ray_commands", "ray start --address")):
        starts = [c for c in cfg.get(key, []) if needle in c]
        if not starts or not all("source ~/qed_env.sh" in c.split(needle)[0] for c in starts):
            problems.append(f"{key}: `{needle}` must run after `source ~/qed_env.sh`")
    return problems


def check_launcher(cfg: dict, provider: str, image: str) -> list[str]:
    """Project requirements on a launcher config, beyond what Ray's schema checks (trust boundaries: trust.py)."""
    return (_node_type_problems(cfg, provider) + _docker_problems(cfg, image) + environment_problems(cfg, provider)
            + shared_storage_problems(cfg, provider))


def all_shell_commands(cfg: dict) -> list[str]:
    """Every shell command of the config (global and per node type)."""
    keys = ("initialization_commands", "setup_commands", "head_setup_commands",
            "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    cmds = [c for k in keys for c in cfg.get(k, [])]
    for t in cfg["available_node_types"].values():
        for k in ("initialization_commands", "worker_setup_commands"):
            cmds += t.get(k, [])
    return cmds


def bash_syntax_errors(cmds: list[str]) -> list[str]:
    """`bash -n` of each command: the ones that do not parse, with bash's message."""
    errors = []
    for cmd in cmds:
        proc = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            errors.append(f"{cmd[:60]}...: {proc.stderr.strip()}")
    return errors
