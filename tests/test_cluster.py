"""Offline validation of the cluster configs (cluster/) and the image recipe (docker/).

No cloud credentials, no Docker engine and no Kubernetes are needed: the launcher YAMLs go through
Ray's own validators, the KubeRay CR through Ray's KubeRay-to-autoscaler conversion, and everything
else through the project checks below, which read the pins from pyproject.toml. Each check is also
run on a deliberately broken copy to show that it rejects it with the expected message.

Ray's validators are private APIs (``ray.autoscaler._private...``); they are pinned by the
``ray[tune,default]`` series in pyproject.toml and used in this module only.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

import jsonschema
import pytest
import ray
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
DOCKER = ROOT / "docker"
LAUNCHERS = {"aws": CLUSTER / "aws.yaml", "gcp": CLUSTER / "gcp.yaml"}
# MLflow artifacts go to the provider's object store (through the tracking server).
STORAGE_SCHEME = {"aws": "s3", "gcp": "gs"}
# Sweep results must be on a shared POSIX file system (the sweep refuses s3:// and gs:// storage paths:
# snapshots, replay chunks, DONE markers and sweep.json are plain files every node reads and writes),
# mounted at this path on every node: EFS (AWS), Filestore (GCP), a ReadWriteMany volume (KubeRay).
SHARED_MOUNT = PurePosixPath("/mnt/qed")
STORAGE_PATH = SHARED_MOUNT / "sweeps"
# The image's non-root user, who must be able to write the storage folder.
RAY_UID = "1000"

# The CLI that qed_ray.envs provides (loads all 18 tasks, one line per task): the image's smoke test.
SMOKE_CMD = "python -m qed_ray.envs --check-all"
# Any image reference of the project's image, whatever registry replaces the placeholder.
IMAGE_RE = re.compile(r"[\w.\-]+(?:/[\w.\-]+)*/qed-ray:[\w.\-]+")


# --------------------------------------------------------------------------------------------------
# pins from pyproject.toml
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pins:
    specs: dict[str, SpecifierSet]  # canonical name -> specifier, runtime dependencies only
    ray_series: str  # "2.60" from ray[tune,default]>=2.60,<2.61
    python_min: Version  # from requires-python
    makefile_torch: str | None  # the torch pin the Makefile installs, if any


def load_pins(root: Path = ROOT) -> Pins:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    specs = {}
    for dep in project["dependencies"]:
        req = Requirement(dep)
        specs[canonicalize_name(req.name)] = req.specifier
    lower = [Version(s.version) for s in specs["ray"] if s.operator in (">=", "==", "~=")]
    assert lower, "pyproject.toml: ray needs a lower bound to define its series"
    ray_series = f"{lower[0].major}.{lower[0].minor}"
    python_min = Version(re.search(r">=\s*([\d.]+)", project["requires-python"]).group(1))
    makefile = root / "Makefile"
    m = re.search(r"torch==([\w.+]+)", makefile.read_text()) if makefile.exists() else None
    return Pins(specs, ray_series, python_min, m.group(1) if m else None)


@pytest.fixture(scope="module")
def pins() -> Pins:
    return load_pins()


def test_pins_are_parsed_from_pyproject(pins):
    assert pins.ray_series == "2.60"
    assert Version(ray.__version__) in pins.specs["ray"], (
        f"installed ray {ray.__version__} is outside pyproject's {pins.specs['ray']}"
    )
    assert ray.__version__.startswith(pins.ray_series + ".")


# --------------------------------------------------------------------------------------------------
# Ray cluster launcher configs (aws.yaml, gcp.yaml)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def no_cloud_env(monkeypatch):
    """Nothing here may reach a cloud: drop credentials/profiles that could change behaviour."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_", "KUBECONFIG")):
            monkeypatch.delenv(key, raising=False)


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def ray_validate(cfg: dict) -> dict:
    """What `ray up` does offline: merge provider defaults, then schema + consistency checks."""
    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def head_and_gpu_types(cfg: dict) -> tuple[dict, list[tuple[str, dict]]]:
    types = cfg["available_node_types"]
    head = types.get(cfg.get("head_node_type"), {})
    gpu = [
        (name, t)
        for name, t in types.items()
        if name != cfg.get("head_node_type") and t.get("resources", {}).get("GPU", 0) >= 1
    ]
    return head, gpu


def env_file_values(setup_cmds: list[str]) -> dict[str, str]:
    """NAME=value pairs that the setup commands write to ~/qed_env.sh (quoted printf arguments)."""
    text = " ".join(setup_cmds)
    return dict(re.findall(r'"([A-Z][A-Z0-9_]*)=([^"]*)"', text))


def is_under(path: str | PurePosixPath, root: str | PurePosixPath) -> bool:
    """An absolute POSIX path at or below root (no URIs, no relative paths, no '..')."""
    path = PurePosixPath(path)
    return path.is_absolute() and ".." not in path.parts and path.is_relative_to(root)


# `mount -t nfs|nfs4 [-o OPTS] SERVER:EXPORT TARGET`, as written in the initialization_commands.
NFS_MOUNT_RE = re.compile(r"\bmount\s+-t\s+nfs4?\s+(?:-o\s+\S+\s+)?(\S+:\S*)\s+(/\S*)")


def nfs_mounts(cmds: list[str]) -> dict[str, tuple[str, str]]:
    """NFS mount target -> (source, the whole command) in a list of host commands."""
    return {m.group(2).rstrip(";)}"): (m.group(1), cmd) for cmd in cmds for m in NFS_MOUNT_RE.finditer(cmd)}


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


def shared_storage_problems(cfg: dict, provider: str) -> list[str]:
    """QED_STORAGE_PATH must be the same folder of one shared NFS file system on every node: mounted on every
    node type's host (idempotently: `ray up` reruns it), bind-mounted into every container at the same path,
    and writable by the container's user."""
    env = env_file_values(cfg.get("setup_commands", []))
    storage = env.get("QED_STORAGE_PATH", "")
    if not is_under(storage, SHARED_MOUNT):
        return [f"setup_commands must export QED_STORAGE_PATH under {SHARED_MOUNT} (the shared file system "
                f"mounted on every node), got {storage!r}; the sweep refuses s3:// and gs:// URIs"]
    problems = []
    docker = cfg.get("docker", {})
    head_type = cfg.get("head_node_type")
    inits = node_init_commands(cfg)
    locations = {}
    for name in cfg["available_node_types"]:
        role = "head" if name == head_type else "worker"
        binds = bind_mounts(docker.get("run_options", []) + docker.get(f"{role}_run_options", []))
        inside = [c for c in binds if is_under(storage, c)]
        if not inside:
            problems.append(f"{name}: QED_STORAGE_PATH {storage} is not on a `-v HOST:CONTAINER` bind mount of "
                            f"this node's container (docker run_options / {role}_run_options)")
            continue
        container_dir = max(inside, key=len)
        host_storage = PurePosixPath(binds[container_dir]) / PurePosixPath(storage).relative_to(container_dir)
        mounts = nfs_mounts(inits[name])
        targets = [tgt for tgt in mounts if is_under(host_storage, tgt)]
        if not targets:
            problems.append(f"{name}: no `mount -t nfs...` of {host_storage} in this node type's "
                            f"initialization_commands (every node must mount the shared file system)")
            continue
        target = max(targets, key=len)
        source, cmd = mounts[target]
        if not re.search(rf"mountpoint\s+-q\s+{re.escape(target)}\s*\|\|", cmd):
            problems.append(f"{name}: the mount of {target} must be skipped when already mounted "
                            f"(`mountpoint -q {target} || ...`): `ray up` reruns initialization_commands")
        if provider == "aws" and not re.fullmatch(
                rf"fs-[\w-]+\.efs\.{re.escape(cfg['provider']['region'])}\.amazonaws\.com:/\S*", source):
            problems.append(f"{name}: {source} is not an EFS file system in {cfg['provider']['region']}")
        locations[name] = (source, str(host_storage.relative_to(target)), storage)
        if name == head_type and not re.search(
                rf"chown\s+{RAY_UID}(:\d+)?\s+{re.escape(str(host_storage))}(\s|$|;|&)", " ; ".join(inits[name])):
            problems.append(f"{name}: initialization_commands must create {host_storage} owned by uid {RAY_UID} "
                            f"(the container's ray user writes the sweeps there)")
    if len(set(locations.values())) > 1:
        problems.append(f"node types do not share the same storage folder on the same file system: {locations}")
    return problems


def check_launcher(cfg: dict, provider: str, image: str) -> list[str]:
    """Project requirements on a launcher config, beyond what Ray's schema checks."""
    problems = []
    head, gpu_types = head_and_gpu_types(cfg)
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
    if provider == "aws":
        for name, t in gpu_types:
            if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") != "spot":
                problems.append(f"{name}: InstanceMarketOptions.MarketType should be spot")

    docker = cfg.get("docker", {})
    if docker.get("image") != image:
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

    env = env_file_values(cfg.get("setup_commands", []))
    uri = urlparse(env.get("MLFLOW_TRACKING_URI", ""))
    if uri.scheme != "http" or uri.port != 5000:
        problems.append("setup_commands must export MLFLOW_TRACKING_URI=http://<head>:5000")
    scheme = STORAGE_SCHEME[provider]
    problems += shared_storage_problems(cfg, provider)
    if env.get("RAY_AUTH_MODE") != "token":
        problems.append("setup_commands must export RAY_AUTH_MODE=token")

    head_start = " ".join(cfg.get("head_start_ray_commands", []))
    if "mlflow server" not in head_start or "--port 5000" not in head_start:
        problems.append("head_start_ray_commands must start `mlflow server` on port 5000")
    if "--artifacts-destination" not in head_start:
        problems.append("the MLflow server needs --artifacts-destination (object store)")
    if not env.get("QED_MLFLOW_ARTIFACTS", "").startswith(f"{scheme}://"):
        problems.append(f"QED_MLFLOW_ARTIFACTS must be a {scheme}:// URI")
    for key, needle in (("head_start_ray_commands", "ray start --head"),
                        ("worker_start_ray_commands", "ray start --address")):
        cmds = cfg.get(key, [])
        starts = [c for c in cmds if needle in c]
        if not starts or not all("source ~/qed_env.sh" in c.split(needle)[0] for c in starts):
            problems.append(f"{key}: `{needle}` must run after `source ~/qed_env.sh`")
    return problems


def all_shell_commands(cfg: dict) -> list[str]:
    keys = ("initialization_commands", "setup_commands", "head_setup_commands",
            "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands")
    cmds = [c for k in keys for c in cfg.get(k, [])]
    for t in cfg["available_node_types"].values():
        for k in ("initialization_commands", "worker_setup_commands"):
            cmds += t.get(k, [])
    return cmds


def bash_syntax_errors(cmds: list[str]) -> list[str]:
    errors = []
    for cmd in cmds:
        proc = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        if proc.returncode != 0:
            errors.append(f"{cmd[:60]}...: {proc.stderr.strip()}")
    return errors


@pytest.fixture(scope="module")
def documented_images() -> dict[str, str]:
    """The image tags docker/README.md documents, keyed by variant (gpu/cpu)."""
    tags = set(IMAGE_RE.findall((DOCKER / "README.md").read_text()))
    by_variant = {t.rsplit("-", 1)[-1]: t for t in tags}
    assert set(by_variant) == {"gpu", "cpu"}, f"docker/README.md should document one gpu and one cpu tag: {tags}"
    return by_variant


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
def test_launcher_config_passes_ray_validation(provider):
    prepared = ray_validate(load_yaml(LAUNCHERS[provider]))
    # prepare_config merged the provider defaults: our explicit command lists must have won
    # (otherwise the defaults' `pip install ray-nightly` setup command would run on the nodes).
    assert not any("pip install" in c for c in prepared["head_setup_commands"] + prepared["worker_setup_commands"])
    assert prepared["available_node_types"][prepared["head_node_type"]]["max_workers"] == 0


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
def test_launcher_config_meets_project_requirements(provider, documented_images):
    assert check_launcher(load_yaml(LAUNCHERS[provider]), provider, documented_images["gpu"]) == []


def _set(path: str, value):
    """Mutation that sets cfg[a][b]... = value (keys separated by '/')."""
    def mutate(cfg):
        *parents, last = path.split("/")
        node = cfg
        for key in parents:
            node = node[key]
        node[last] = value
    return mutate


def _del(path: str):
    def mutate(cfg):
        *parents, last = path.split("/")
        node = cfg
        for key in parents:
            node = node[key]
        del node[last]
    return mutate


RAY_REJECTS = [
    ("unknown top-level key", _set("min_wrokers", 1), jsonschema.ValidationError,
     r"Additional properties are not allowed \('min_wrokers' was unexpected\)"),
    ("max_workers not an integer", _set("max_workers", "eight"), jsonschema.ValidationError,
     r"'eight' is not of type 'integer'"),
    ("head_node_type not a node type", _set("head_node_type", "ray.head.missing"), ValueError,
     r"`head_node_type` must be one of `available_node_types`"),
    ("min_workers above global max", _set("available_node_types/gpu_worker/min_workers", 9), ValueError,
     r"global `max_workers` is smaller than the sum of `min_workers`"),
    ("node type without resources", _del("available_node_types/gpu_worker/resources"),
     jsonschema.ValidationError, r"'resources' is a required property"),
    ("unknown docker key", _set("docker/gpus", True), jsonschema.ValidationError,
     r"Additional properties are not allowed \('gpus' was unexpected\)"),
]


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
@pytest.mark.parametrize("name,mutate,exc,message", RAY_REJECTS, ids=[r[0] for r in RAY_REJECTS])
def test_broken_launcher_config_is_rejected_by_ray(provider, name, mutate, exc, message):
    cfg = load_yaml(LAUNCHERS[provider])
    mutate(cfg)
    with pytest.raises(exc, match=message):
        ray_validate(cfg)


def _replace_in_list(key: str, old: str, new: str):
    def mutate(cfg):
        cfg[key] = [c.replace(old, new) for c in cfg[key]]
    return mutate


def _edit_list(path: str, edit):
    """Mutation that replaces the list at cfg[a][b]... by edit(list)."""
    def mutate(cfg):
        *parents, last = path.split("/")
        node = cfg
        for key in parents:
            node = node[key]
        node[last] = edit(node[last])
    return mutate


def _without_mount(cmds: list[str]) -> list[str]:
    return [c for c in cmds if not NFS_MOUNT_RE.search(c)]


def _everywhere(old: str, new: str):
    """Mutation that edits every host command (global and per node type)."""
    def mutate(cfg):
        for holder in [cfg] + list(cfg["available_node_types"].values()):
            if "initialization_commands" in holder:
                holder["initialization_commands"] = [c.replace(old, new) for c in holder["initialization_commands"]]
    return mutate


def _other_fs_on_workers(cfg):
    cmds = cfg["available_node_types"]["gpu_worker"]["initialization_commands"]
    cfg["available_node_types"]["gpu_worker"]["initialization_commands"] = [
        NFS_MOUNT_RE.sub(lambda m: m.group(0).replace(m.group(1), m.group(1).replace(":", "-other:", 1)), c)
        for c in cmds]


def _bind_on_workers_only(cfg):
    bind = f"-v {SHARED_MOUNT}:{SHARED_MOUNT}"
    cfg["docker"]["run_options"] = [o for o in cfg["docker"]["run_options"] if o != bind]
    cfg["docker"]["worker_run_options"] = cfg["docker"]["worker_run_options"] + [bind]


PROJECT_REJECTS = [
    ("trials allowed on head", _set("available_node_types/head/resources", {"CPU": 8}), "CPU: 0"),
    ("GPU worker without --gpus", _set("docker/worker_run_options", ["--shm-size=20g"]), "--gpus all"),
    ("--gpus on the CPU head", _set("docker/run_options", ["--gpus all", "-e MUJOCO_GL=egl"]), "CPU head"),
    ("stale image tag", _set("docker/image", "ghcr.io/your-org/qed-ray:2.59.0-py311-gpu"), "docker.image"),
    ("local storage path", _replace_in_list("setup_commands", "QED_STORAGE_PATH=", "QED_STORAGE_PATH=/tmp/x#"),
     "QED_STORAGE_PATH"),
    ("s3 storage path", _replace_in_list("setup_commands", f"QED_STORAGE_PATH={STORAGE_PATH}",
                                         "QED_STORAGE_PATH=s3://your-qed-bucket/qed-ray/sweeps"), "QED_STORAGE_PATH"),
    ("gs storage path", _replace_in_list("setup_commands", f"QED_STORAGE_PATH={STORAGE_PATH}",
                                         "QED_STORAGE_PATH=gs://your-qed-bucket/qed-ray/sweeps"), "QED_STORAGE_PATH"),
    ("storage path outside the mount", _replace_in_list("setup_commands", f"QED_STORAGE_PATH={STORAGE_PATH}",
                                                        "QED_STORAGE_PATH=/home/ray/sweeps"), "QED_STORAGE_PATH"),
    ("storage path escapes the mount", _replace_in_list("setup_commands", f"QED_STORAGE_PATH={STORAGE_PATH}",
                                                        f"QED_STORAGE_PATH={SHARED_MOUNT}/../sweeps"), "QED_STORAGE_PATH"),
    ("worker without the shared mount", _edit_list("available_node_types/gpu_worker/initialization_commands",
                                                   _without_mount), "gpu_worker: no `mount -t nfs"),
    ("head without the shared mount", _edit_list("initialization_commands", _without_mount), "head: no `mount -t nfs"),
    ("mount not bound into the containers",
     _edit_list("docker/run_options", lambda opts: [o for o in opts if str(SHARED_MOUNT) not in o]), "bind mount"),
    ("mount bound on workers only", _bind_on_workers_only, "head: QED_STORAGE_PATH"),
    ("workers mount another file system", _other_fs_on_workers, "same storage folder"),
    ("mount not idempotent", _everywhere(f"mountpoint -q {SHARED_MOUNT} ||", ""), "mountpoint -q"),
    ("storage folder not writable by ray", _everywhere(f"chown 1000:100 {STORAGE_PATH}", "true"), "uid 1000"),
    ("no MLflow server", _set("head_start_ray_commands", ["ray stop", "source ~/qed_env.sh && ray start --head"]),
     "mlflow server"),
    ("ray start before env", _set("worker_start_ray_commands", ["ray start --address=$RAY_HEAD_IP:6379"]),
     "source ~/qed_env.sh"),
]


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
@pytest.mark.parametrize("name,mutate,message", PROJECT_REJECTS, ids=[r[0] for r in PROJECT_REJECTS])
def test_broken_launcher_config_is_rejected_by_project_checks(provider, name, mutate, message, documented_images):
    cfg = load_yaml(LAUNCHERS[provider])
    mutate(cfg)
    problems = check_launcher(cfg, provider, documented_images["gpu"])
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
def test_launcher_shell_commands_are_valid_bash(provider):
    cmds = all_shell_commands(load_yaml(LAUNCHERS[provider]))
    assert len(cmds) >= 5
    assert bash_syntax_errors(cmds) == []
    # ...and the check does catch a broken command (unbalanced quote).
    assert bash_syntax_errors(["source ~/qed_env.sh && echo 'unterminated"])


# Stand-ins for the host tools the mount commands call: they log instead of touching the machine.
HOST_STUBS = {
    "sudo": 'while [[ "$1" == *=* ]]; do export "$1"; shift; done; exec "$@"',
    "mountpoint": '[ -e "$STATE/mounted" ]',
    "mount": 'echo "mount $*" >> "$STATE/log"; [ -z "$MOUNT_FAILS" ] || exit 32; : > "$STATE/mounted"',
    "mkdir": 'echo "mkdir $*" >> "$STATE/log"',
    "chown": 'echo "chown $*" >> "$STATE/log"',
    "apt-get": 'echo "apt-get $*" >> "$STATE/log"',
}


def _run_host_commands(cmds: list[str], tmp: Path, **env) -> tuple[list[int], list[str]]:
    stubs = tmp / "bin"
    stubs.mkdir(exist_ok=True)
    for name, body in HOST_STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    rcs = [subprocess.run(["/bin/bash", "-c", cmd], env={"PATH": str(stubs), "STATE": str(tmp), **env},
                          timeout=30).returncode for cmd in cmds]
    log = tmp / "log"
    return rcs, log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
def test_shared_mount_commands_are_idempotent_and_fail_loudly(provider, tmp_path):
    """Run each node type's mount command twice against stub host tools (a fresh host without the NFS client):
    one install, one mount, the sweeps folder handed to the ray user; and a failed mount fails the command
    (so `ray up` stops) instead of leaving results on the node's local disk."""
    cfg = load_yaml(LAUNCHERS[provider])
    for name, cmds in node_init_commands(cfg).items():
        mount_cmds = [c for c in cmds if NFS_MOUNT_RE.search(c)]
        assert len(mount_cmds) == 1, f"{name}: expected one mount command, got {mount_cmds}"
        host = tmp_path / name
        host.mkdir()
        rcs, log = _run_host_commands(mount_cmds * 2, host)
        assert rcs == [0, 0], log
        mounts = [line for line in log if line.startswith("mount ")]
        assert len(mounts) == 1 and mounts[0].split()[-1] == str(SHARED_MOUNT), log
        assert re.match(r"mount -t nfs4? ", mounts[0])
        assert sum("install" in line and "nfs-common" in line for line in log) == 1, log
        assert log.index(f"mkdir -p {SHARED_MOUNT}") < log.index(mounts[0])
        assert log.count(f"chown {RAY_UID}:100 {STORAGE_PATH}") == 2  # re-applied on every `ray up`

        failing = tmp_path / f"{name}-fails"
        failing.mkdir()
        rcs, log = _run_host_commands(mount_cmds, failing, MOUNT_FAILS="1")
        assert rcs[0] != 0, log
        assert not any(line.startswith(("chown", f"mkdir -p {STORAGE_PATH}")) for line in log), log


def _run_setup(cfg: dict, home: Path, extra_env: dict[str, str]) -> dict[str, str]:
    """Run the config's setup_commands in a scratch HOME, then report what a fresh shell that
    sources ~/qed_env.sh sees (exactly what `ray start` inherits)."""
    env = {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           **extra_env}
    for cmd in cfg["setup_commands"]:
        subprocess.run(["bash", "-c", cmd], env=env, check=True, timeout=120)
    names = ("MLFLOW_TRACKING_URI", "QED_STORAGE_PATH", "RAY_AUTH_MODE", "QED_MLFLOW_BACKEND_STORE_URI")
    out = subprocess.run(["bash", "-c", "source ~/qed_env.sh && " + " && ".join(f'echo "{n}=${n}"' for n in names)],
                         env={"HOME": str(home), "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


@pytest.mark.parametrize("provider", sorted(LAUNCHERS))
def test_setup_commands_give_workers_the_head_tracking_uri(provider, tmp_path):
    cfg = ray_validate(load_yaml(LAUNCHERS[provider]))
    # On workers the autoscaler exports RAY_HEAD_IP to setup commands.
    seen = _run_setup(cfg, tmp_path, {"RAY_HEAD_IP": "10.1.2.3"})
    assert seen["MLFLOW_TRACKING_URI"] == "http://10.1.2.3:5000"
    assert seen["QED_STORAGE_PATH"] == str(STORAGE_PATH)
    assert seen["RAY_AUTH_MODE"] == "token"
    assert seen["QED_MLFLOW_BACKEND_STORE_URI"].startswith("sqlite:////")  # absolute path
    # Re-running setup (every `ray up`) must not stack up .bashrc lines.
    _run_setup(cfg, tmp_path, {"RAY_HEAD_IP": "10.1.2.3"})
    assert (tmp_path / ".bashrc").read_text().count("qed_env.sh") == 1


def test_setup_commands_on_head_use_rays_own_node_ip(tmp_path):
    # `ray up` does not export RAY_HEAD_IP on the head: the head asks Ray, the same function the
    # autoscaler uses to tell the workers the head's address, so both sides agree.
    cfg = ray_validate(load_yaml(LAUNCHERS["aws"]))
    seen = _run_setup(cfg, tmp_path, {})
    assert seen["MLFLOW_TRACKING_URI"] == f"http://{ray.util.get_node_ip_address()}:5000"


# --------------------------------------------------------------------------------------------------
# KubeRay (kuberay.yaml, kuberay-mlflow.yaml)
# --------------------------------------------------------------------------------------------------
def load_docs(path: Path) -> dict[str, dict]:
    """Multi-document manifest -> {kind: doc} (one document per kind in our files)."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    kinds = [d["kind"] for d in docs]
    assert len(kinds) == len(set(kinds)), f"{path.name}: duplicate kinds {kinds}"
    return {d["kind"]: d for d in docs}


@pytest.fixture()
def ray_cr() -> dict:
    return copy.deepcopy(load_docs(CLUSTER / "kuberay.yaml")["RayCluster"])


def ray_containers(cr: dict) -> list[tuple[str, dict, dict]]:
    """(group name, container, pod spec) of the Ray container of the head and each worker group."""
    spec = cr.get("spec", {})
    out = []
    groups = [("head", spec.get("headGroupSpec", {}))] + [
        (g.get("groupName", "?"), g) for g in spec.get("workerGroupSpecs", [])]
    for name, group in groups:
        pod = group.get("template", {}).get("spec", {})
        containers = pod.get("containers", [])
        if containers:
            out.append((name, containers[0], pod))
    return out


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


def shared_volume_problems(cr: dict, docs: dict[str, dict]) -> list[str]:
    """The head and every worker group keep QED_STORAGE_PATH on one ReadWriteMany claim of this manifest, mounted at
    the same path, and a root init container hands the sweeps folder to the ray user before Ray starts."""
    problems, seen = [], {}
    for name, container, pod in ray_containers(cr):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        storage = env.get("QED_STORAGE_PATH") or ""
        claim = storage_claim(container, pod, storage) if is_under(storage, SHARED_MOUNT) else None
        if claim is None:
            problems.append(f"{name}: does not keep QED_STORAGE_PATH {storage!r} on a mounted PersistentVolumeClaim")
        else:
            seen[name] = (*claim, storage)
    if len(set(seen.values())) > 1:
        problems.append(f"head and worker pods must mount the same claim at the same path: {seen}")
    ns = cr.get("metadata", {}).get("namespace")
    pvc = docs.get("PersistentVolumeClaim")
    for claim_name in {c[0] for c in seen.values()}:
        if not pvc or pvc["metadata"].get("name") != claim_name:
            problems.append(f"PersistentVolumeClaim {claim_name!r} is not defined in kuberay.yaml")
            continue
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
    head = cr.get("spec", {}).get("headGroupSpec", {}).get("template", {}).get("spec", {})
    if "head" in seen:
        claim, mount_path, sub_path, storage = seen["head"]
        ok = False
        for init in head.get("initContainers", []):
            shell = " ".join(init.get("command", []) + init.get("args", []))
            ok |= (init.get("securityContext", {}).get("runAsUser") == 0
                   and storage_claim(init, head, storage) == (claim, mount_path, sub_path)
                   and f"mkdir -p {storage}" in shell
                   and re.search(rf"chown\s+{RAY_UID}(:\d+)?\s+{re.escape(storage)}\b", shell) is not None)
        if not ok:
            problems.append(f"head: needs an initContainer (runAsUser 0, same volume) that creates {storage} "
                            f"owned by uid {RAY_UID} (a fresh volume's root belongs to root)")
    return problems


def check_kuberay(cr: dict, pins: Pins) -> list[str]:
    """Project requirements on the RayCluster CR (KubeRay ships no schema in the Ray wheel)."""
    problems = []
    spec = cr.get("spec", {})
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

    gpu_groups = 0
    for group in spec.get("workerGroupSpecs", []):
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

    for name, container, pod in ray_containers(cr):
        tag = container.get("image", "").rsplit(":", 1)[-1]
        if not tag.startswith(ray_version + "-"):
            problems.append(f"{name}: image tag {tag!r} does not match rayVersion {ray_version!r}")
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
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
        shm_volumes = {v["name"] for v in pod.get("volumes", [])
                       if v.get("emptyDir", {}).get("medium") == "Memory"}
        if not any(m.get("mountPath") == "/dev/shm" and m.get("name") in shm_volumes
                   for m in container.get("volumeMounts", [])):
            problems.append(f"{name}: /dev/shm must be a Memory emptyDir")
    return problems


def test_kuberay_cr_converts_to_a_valid_autoscaler_config(ray_cr):
    derived = _derive_autoscaling_config_from_ray_cr(ray_cr)
    validate_config(derived)  # the conversion validates too; be explicit
    types = derived["available_node_types"]
    head = types.pop(derived["head_node_type"])
    assert head["resources"]["CPU"] == 0
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    assert gpu, f"no derived node type with GPU >= 1: {types}"
    group = ray_cr["spec"]["workerGroupSpecs"][0]
    assert gpu[group["groupName"]]["max_workers"] == group["maxReplicas"]
    assert gpu[group["groupName"]]["min_workers"] == 0


def test_kuberay_cr_meets_project_requirements(ray_cr, pins):
    assert check_kuberay(ray_cr, pins) == []


def _gpu_worker(cr):
    return cr["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


def _worker_pod(cr):
    return cr["spec"]["workerGroupSpecs"][0]["template"]["spec"]


def _head_pod(cr):
    return cr["spec"]["headGroupSpec"]["template"]["spec"]


def _set_env(cr, name, value):
    # The manifest shares one env list between containers through a YAML anchor: copy before editing.
    container = _gpu_worker(cr)
    container["env"] = [dict(e, value=value) if e["name"] == name else e for e in container["env"]]


KUBERAY_BROKEN = [
    ("older rayVersion", lambda cr: cr["spec"].update(rayVersion="2.59.0"), "rayVersion '2.59.0'"),
    ("GPU limit removed", lambda cr: _gpu_worker(cr)["resources"]["limits"].pop("nvidia.com/gpu"),
     "nvidia.com/gpu >= 1"),
    ("autoscaling off", lambda cr: cr["spec"].update(enableInTreeAutoscaling=False), "enableInTreeAutoscaling"),
    ("min above max", lambda cr: cr["spec"]["workerGroupSpecs"][0].update(minReplicas=9), "minReplicas (9)"),
    ("image tag drift", lambda cr: _gpu_worker(cr).update(image="ghcr.io/your-org/qed-ray:2.59.0-py311-gpu"),
     "does not match rayVersion"),
    ("no namespace", lambda cr: cr["metadata"].pop("namespace"), "metadata.namespace"),
    ("wrong apiVersion", lambda cr: cr.update(apiVersion="ray.io/v1alpha1"), "apiVersion"),
    ("head runs trials", lambda cr: cr["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": "8"}),
     "num-cpus"),
    ("no graphics capability", lambda cr: _set_env(cr, "NVIDIA_DRIVER_CAPABILITIES", "compute,utility"),
     "NVIDIA_DRIVER_CAPABILITIES"),
    ("local storage", lambda cr: _set_env(cr, "QED_STORAGE_PATH", "/home/ray/results"), "QED_STORAGE_PATH"),
    ("s3 storage", lambda cr: _set_env(cr, "QED_STORAGE_PATH", "s3://your-qed-bucket/qed-ray/sweeps"),
     "gpu: env QED_STORAGE_PATH"),
    ("gs storage", lambda cr: _set_env(cr, "QED_STORAGE_PATH", "gs://your-qed-bucket/qed-ray/sweeps"),
     "gpu: env QED_STORAGE_PATH"),
    ("worker without the results volume", lambda cr: _gpu_worker(cr).update(
        volumeMounts=[m for m in _gpu_worker(cr)["volumeMounts"] if m["name"] != "results"]),
     "gpu: env QED_STORAGE_PATH /mnt/qed/sweeps is not on a persistentVolumeClaim"),
    ("results volume not a claim", lambda cr: _worker_pod(cr).update(
        volumes=[v if v["name"] != "results" else {"name": "results", "emptyDir": {}} for v in _worker_pod(cr)["volumes"]]),
     "not on a persistentVolumeClaim"),
    ("no /dev/shm", lambda cr: _gpu_worker(cr).update(volumeMounts=[]), "/dev/shm"),
    ("no GPU toleration", lambda cr: cr["spec"]["workerGroupSpecs"][0]["template"]["spec"].update(tolerations=[]),
     "toleration"),
]


@pytest.mark.parametrize("name,mutate,message", KUBERAY_BROKEN, ids=[b[0] for b in KUBERAY_BROKEN])
def test_broken_kuberay_cr_is_rejected(ray_cr, pins, name, mutate, message):
    mutate(ray_cr)
    problems = check_kuberay(ray_cr, pins)
    assert any(message in p for p in problems), problems


def test_kuberay_results_volume_is_shared_by_every_pod(ray_cr):
    docs = load_docs(CLUSTER / "kuberay.yaml")
    assert shared_volume_problems(ray_cr, docs) == []
    # the same claim at the same path in every Ray pod, holding QED_STORAGE_PATH
    claims = {storage_claim(c, pod, str(STORAGE_PATH)) for _, c, pod in ray_containers(ray_cr)}
    assert claims == {(docs["PersistentVolumeClaim"]["metadata"]["name"], str(SHARED_MOUNT), "")}
    assert len(ray_containers(ray_cr)) == 1 + len(ray_cr["spec"]["workerGroupSpecs"])


def _worker_mount(cr, **changes):
    _gpu_worker(cr)["volumeMounts"] = [dict(m, **changes) if m["name"] == "results" else m
                                       for m in _gpu_worker(cr)["volumeMounts"]]


def _worker_claim(cr, claim):
    _worker_pod(cr)["volumes"] = [{"name": "results", "persistentVolumeClaim": {"claimName": claim}}
                                  if v["name"] == "results" else v for v in _worker_pod(cr)["volumes"]]


@pytest.mark.parametrize("name,mutate,message", [
    ("worker mounts another claim", lambda cr, d: _worker_claim(cr, "other-results"), "same claim"),
    ("worker mounts a sub folder", lambda cr, d: _worker_mount(cr, subPath="worker"), "same claim"),
    ("worker mounts at another path",
     lambda cr, d: (_worker_mount(cr, mountPath="/data"), _set_env(cr, "QED_STORAGE_PATH", "/data/sweeps")),
     "gpu: does not keep QED_STORAGE_PATH"),
    ("worker without the results volume", lambda cr, d: _worker_mount(cr, name="dshm-typo"),
     "gpu: does not keep QED_STORAGE_PATH"),
    ("claim not in the manifest", lambda cr, d: d.pop("PersistentVolumeClaim"), "is not defined"),
    ("claim is ReadWriteOnce", lambda cr, d: d["PersistentVolumeClaim"]["spec"].update(accessModes=["ReadWriteOnce"]),
     "ReadWriteMany"),
    ("claim in another namespace", lambda cr, d: d["PersistentVolumeClaim"]["metadata"].update(namespace="default"),
     "namespace"),
    ("claim without storage class", lambda cr, d: d["PersistentVolumeClaim"]["spec"].pop("storageClassName"),
     "storageClassName"),
    ("no permissions init container", lambda cr, d: _head_pod(cr).pop("initContainers"), "initContainer"),
    ("init container not root", lambda cr, d: _head_pod(cr)["initContainers"][0].update(securityContext={}),
     "initContainer"),
])
def test_broken_kuberay_results_volume_is_rejected(ray_cr, name, mutate, message):
    docs = copy.deepcopy(load_docs(CLUSTER / "kuberay.yaml"))
    mutate(ray_cr, docs)
    problems = shared_volume_problems(ray_cr, docs)
    assert any(message in p for p in problems), problems


def test_kuberay_cr_without_namespace_cannot_be_converted(ray_cr):
    del ray_cr["metadata"]["namespace"]
    with pytest.raises(KeyError, match="namespace"):
        _derive_autoscaling_config_from_ray_cr(ray_cr)


def mlflow_args(deployment: dict) -> dict[str, str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return dict(a.lstrip("-").split("=", 1) for a in container.get("args", []) if "=" in a)


def mlflow_reachability_problems(cr: dict, manifests: dict[str, dict]) -> list[str]:
    """Can every Ray pod reach the MLflow server at its MLFLOW_TRACKING_URI?"""
    from mlflow.server.security_utils import is_allowed_host_header

    problems = []
    svc, dep = manifests.get("Service"), manifests.get("Deployment")
    if not svc or not dep:
        return ["kuberay-mlflow.yaml needs a Deployment and a Service"]
    pod_labels = dep["spec"]["template"]["metadata"].get("labels", {})
    if not svc["spec"].get("selector") or svc["spec"]["selector"].items() - pod_labels.items():
        problems.append("Service selector does not match the Deployment's pod labels")
    ns = cr["metadata"].get("namespace")
    for obj in (svc, dep):
        if obj["metadata"].get("namespace") != ns:
            problems.append(f"{obj['kind']} must be in the RayCluster's namespace {ns!r}")
    port = svc["spec"]["ports"][0]["port"]
    args = mlflow_args(dep)
    allowed = [h.strip() for h in args.get("allowed-hosts", "").split(",") if h.strip()]
    for name, container, _ in ray_containers(cr):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        uri = urlparse(env.get("MLFLOW_TRACKING_URI") or "")
        expected_host = f"{svc['metadata']['name']}.{ns}.svc.cluster.local"
        if uri.hostname != expected_host or uri.port != port:
            problems.append(f"{name}: MLFLOW_TRACKING_URI {uri.geturl()!r} is not the Service "
                            f"http://{expected_host}:{port}")
        # MLflow 3 rejects unknown Host headers; the pods send "<host>:<port>".
        if not allowed or not is_allowed_host_header(allowed, uri.netloc):
            problems.append(f"{name}: MLflow --allowed-hosts rejects Host {uri.netloc!r}")
    if not is_allowed_host_header(allowed or ["-"], "localhost:5000"):
        problems.append("MLflow --allowed-hosts rejects localhost (kubectl port-forward)")
    if str(args.get("port")) != str(port) and args.get("port") is not None:
        problems.append(f"MLflow listens on {args.get('port')}, Service targets {port}")
    if args.get("host") != "0.0.0.0":
        problems.append("MLflow must bind 0.0.0.0 to be reachable through the Service")
    if not re.match(r"(s3|gs)://", args.get("artifacts-destination", "")):
        problems.append("MLflow --artifacts-destination must be an object store (s3:// or gs://)")
    if "sqlite" in args.get("backend-store-uri", "") or "file:" in args.get("backend-store-uri", ""):
        problems.append("MLflow backend must be a database server, not a file in the pod")
    return problems


def test_kuberay_mlflow_server_is_reachable_from_every_ray_pod(ray_cr):
    manifests = load_docs(CLUSTER / "kuberay-mlflow.yaml")
    assert mlflow_reachability_problems(ray_cr, manifests) == []
    env = manifests["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
    backend = next(e for e in env if e["name"] == "MLFLOW_BACKEND_STORE_URI")
    assert backend["valueFrom"]["secretKeyRef"]["name"]  # credentials from a Secret, not the manifest


@pytest.mark.parametrize("name,mutate,message", [
    ("Host header not allowed",
     lambda m, cr: m["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
         -1, "--allowed-hosts=localhost:*"), "--allowed-hosts rejects Host"),
    ("URI points elsewhere", lambda m, cr: _set_env(cr, "MLFLOW_TRACKING_URI", "http://mlflow.default.svc.cluster.local:5000"),
     "is not the Service"),
    ("selector mismatch", lambda m, cr: m["Service"]["spec"].update(selector={"app": "other"}), "selector"),
    ("artifacts on pod disk",
     lambda m, cr: m["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
         1, "--artifacts-destination=/mlartifacts"), "object store"),
])
def test_broken_kuberay_mlflow_wiring_is_rejected(ray_cr, name, mutate, message):
    manifests = load_docs(CLUSTER / "kuberay-mlflow.yaml")
    mutate(manifests, ray_cr)
    problems = mlflow_reachability_problems(ray_cr, manifests)
    assert any(message in p for p in problems), problems


# --------------------------------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------------------------------
@dataclass
class Dockerfile:
    instructions: list[tuple[str, str]]  # (KEYWORD, arguments), continuation lines joined

    @classmethod
    def parse(cls, text: str) -> "Dockerfile":
        out, buf = [], ""
        for line in text.splitlines():
            stripped = line.strip()
            if not buf and (not stripped or stripped.startswith("#")):
                continue
            if buf and stripped.startswith("#"):
                continue  # comment lines inside a continued instruction are ignored by Docker
            if stripped.endswith("\\"):
                buf += stripped[:-1] + " "
                continue
            buf += stripped
            keyword, _, args = buf.partition(" ")
            out.append((keyword.upper(), args.strip()))
            buf = ""
        return cls(out)

    def args_of(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]

    def arg_default(self, name: str) -> str | None:
        for a in self.args_of("ARG"):
            key, _, default = a.partition("=")
            if key == name:
                return default or None
        return None

    def env(self) -> dict[str, str]:
        values = {}
        for a in self.args_of("ENV"):
            for token in shlex.split(a):
                if "=" in token:
                    key, value = token.split("=", 1)
                    values[key] = value
        return values

    def pip_requirements(self) -> list[Requirement]:
        """Requirement specifiers passed to `pip install` in RUN instructions."""
        reqs = []
        takes_value = {"--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-r",
                       "--requirement", "-f", "--find-links", "--target", "-t"}
        for run in self.args_of("RUN"):
            tokens = shlex.split(run)
            i = 0
            while i < len(tokens):
                if tokens[i] == "pip" and i + 1 < len(tokens) and tokens[i + 1] == "install":
                    i += 2
                    while i < len(tokens) and tokens[i] not in ("&&", "||", ";", "|"):
                        tok = tokens[i]
                        if tok in takes_value:
                            i += 2
                            continue
                        if not tok.startswith("-") and tok not in (".", "./") and "$" not in tok:
                            reqs.append(Requirement(tok))
                        i += 1
                i += 1
        return reqs


EXACT_PINS = ("ray", "torch", "mujoco", "dm-control", "mlflow")
HEADLESS_APT = ("libegl1", "libgl1", "libglvnd0", "libopengl0", "libosmesa6")


def check_dockerfile(text: str, pins: Pins) -> list[str]:
    """Image recipe vs pyproject.toml pins and the runtime requirements of the cluster."""
    problems = []
    df = Dockerfile.parse(text)

    base_tag = df.arg_default("BASE_TAG")
    froms = df.args_of("FROM")
    if not froms or not froms[0].startswith("rayproject/ray:${BASE_TAG}"):
        problems.append("first FROM must be rayproject/ray:${BASE_TAG}")
    m = re.fullmatch(r"(\d+\.\d+\.\d+)-py3(\d+)-(gpu|cpu|cu\d+)", base_tag or "")
    if not m:
        problems.append(f"ARG BASE_TAG default {base_tag!r} is not <ray>-py3XX-gpu")
        base_ray = None
    else:
        base_ray, py_minor, _ = m.groups()
        if not base_ray.startswith(pins.ray_series + ".") or base_ray != ray.__version__:
            problems.append(f"BASE_TAG ray {base_ray} is not the pinned/installed ray "
                            f"{pins.ray_series}.x / {ray.__version__}")
        if Version(f"3.{py_minor}") < pins.python_min:
            problems.append(f"BASE_TAG python 3.{py_minor} is below requires-python {pins.python_min}")

    reqs: dict[str, list[Requirement]] = {}
    for req in df.pip_requirements():
        reqs.setdefault(canonicalize_name(req.name), []).append(req)
    for name, spec in pins.specs.items():
        if name not in reqs and name not in EXACT_PINS:
            problems.append(f"pyproject dependency {name} is not installed by the Dockerfile")
    for name in EXACT_PINS:
        if name not in reqs:
            problems.append(f"{name} is not pinned in the Dockerfile")
            continue
        versions = set()
        for req in reqs[name]:
            exact = [s.version for s in req.specifier if s.operator == "=="]
            if len(exact) != 1:
                problems.append(f"{name}: Dockerfile must pin an exact version, got {req}")
                continue
            versions.add(exact[0])
        if len(versions) > 1:
            problems.append(f"{name}: conflicting pins in the Dockerfile {sorted(versions)}")
        for version in versions:
            if name in pins.specs and Version(version) not in pins.specs[name]:
                problems.append(f"{name}=={version} violates pyproject's {name}{pins.specs[name]}")
            if name == "ray" and version != base_ray:
                problems.append(f"ray=={version} differs from the base image's ray {base_ray}")
            if name == "torch" and pins.makefile_torch and version != pins.makefile_torch:
                problems.append(f"torch=={version} differs from the Makefile's torch=={pins.makefile_torch}")
    ray_extras = {e for r in reqs.get("ray", []) for e in r.extras}
    if not {"tune", "default"} <= ray_extras:
        problems.append("ray must be installed with the [tune,default] extras")

    env = df.env()
    if env.get("MUJOCO_GL") != "egl":
        problems.append(f"ENV MUJOCO_GL must be egl, got {env.get('MUJOCO_GL')!r}")
    caps = set(env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(","))
    if not ({"graphics", "all"} & caps):
        problems.append("ENV NVIDIA_DRIVER_CAPABILITIES must include graphics (EGL)")
    if "PYOPENGL_PLATFORM" in env or "MUJOCO_EGL_DEVICE_ID" in env:
        problems.append("do not set PYOPENGL_PLATFORM / MUJOCO_EGL_DEVICE_ID in the image")

    users = df.args_of("USER")
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append(f"the final USER must be non-root, got {users[-1] if users else None!r}")

    runs = " ".join(df.args_of("RUN"))
    for pkg in HEADLESS_APT:
        if not re.search(rf"apt-get install[^&]*\b{re.escape(pkg)}\b", runs):
            problems.append(f"apt package {pkg} (headless rendering) is not installed")
    if "docker/smoke.sh" not in runs:
        problems.append("the Dockerfile must RUN docker/smoke.sh (build-time smoke gate)")
    if not any("--from=smoke" in c for c in df.args_of("COPY")):
        problems.append("the final stage must depend on the smoke stage (COPY --from=smoke)")
    return problems


@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return (DOCKER / "Dockerfile").read_text()


def test_dockerfile_matches_pyproject_pins(dockerfile_text, pins):
    assert check_dockerfile(dockerfile_text, pins) == []


def test_dockerfile_pins_are_the_expected_versions(dockerfile_text):
    pinned = {canonicalize_name(r.name): str(r.specifier) for r in Dockerfile.parse(dockerfile_text).pip_requirements()}
    assert pinned["mujoco"] == "==3.17.0"
    assert pinned["dm-control"] == "==1.0.50"
    assert pinned["mlflow"] == "==3.17.2"
    assert pinned["ray"] == f"=={ray.__version__}"


DOCKERFILE_BROKEN = [
    ("mujoco 4", lambda t: t.replace('"mujoco==3.17.0"', '"mujoco==4.0.0"'), "mujoco==4.0.0 violates"),
    ("dm_control drift", lambda t: t.replace('"dm_control==1.0.50"', '"dm_control==1.0.49"', 1), "dm-control"),
    ("old base image", lambda t: t.replace("BASE_TAG=2.60.0-py311-gpu", "BASE_TAG=2.59.0-py311-gpu"), "BASE_TAG ray 2.59.0"),
    ("ray pin outside series", lambda t: t.replace('"ray[tune,default]==2.60.0"', '"ray[tune,default]==2.61.0"'),
     "violates pyproject"),
    ("python too old", lambda t: t.replace("BASE_TAG=2.60.0-py311-gpu", "BASE_TAG=2.60.0-py310-gpu"), "requires-python"),
    ("no graphics capability", lambda t: t.replace("NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics",
                                                   "NVIDIA_DRIVER_CAPABILITIES=compute,utility"), "graphics"),
    ("glfw backend", lambda t: t.replace("MUJOCO_GL=egl", "MUJOCO_GL=glfw"), "MUJOCO_GL must be egl"),
    ("runs as root", lambda t: t + "\nUSER root\n", "non-root"),
    ("dependency dropped", lambda t: t.replace('"matplotlib>=3.8" ', ""), "matplotlib is not installed"),
    ("no EGL library", lambda t: t.replace("libegl1 ", ""), "libegl1"),
    ("smoke gate removed", lambda t: t.replace("COPY --from=smoke", "# COPY --from=smoke"), "smoke stage"),
]


@pytest.mark.parametrize("name,mutate,message", DOCKERFILE_BROKEN, ids=[b[0] for b in DOCKERFILE_BROKEN])
def test_broken_dockerfile_is_rejected(dockerfile_text, pins, name, mutate, message):
    broken = mutate(dockerfile_text)
    assert broken != dockerfile_text, "mutation did not apply: update the test with the Dockerfile"
    problems = check_dockerfile(broken, pins)
    assert any(message in p for p in problems), problems


# --------------------------------------------------------------------------------------------------
# smoke command and image tags: one string each, everywhere
# --------------------------------------------------------------------------------------------------
def smoke_command_problems(texts: dict[str, str]) -> list[str]:
    """smoke.sh must run SMOKE_CMD; every mention of qed_ray.envs elsewhere must be that string."""
    problems = []
    script = texts.get("docker/smoke.sh", "")
    runs = [ln.strip() for ln in script.splitlines()
            if "qed_ray.envs" in ln and not ln.strip().startswith("#")]
    if runs != [SMOKE_CMD]:
        problems.append(f"docker/smoke.sh must run exactly {SMOKE_CMD!r}, runs {runs}")
    if SMOKE_CMD not in texts.get("docker/README.md", ""):
        problems.append(f"docker/README.md does not document {SMOKE_CMD!r}")
    for name, text in texts.items():
        for mention in re.findall(r"python -m qed_ray\.envs[^\n`'\"]*", text):
            if mention.strip() != SMOKE_CMD:
                problems.append(f"{name}: {mention.strip()!r} differs from {SMOKE_CMD!r}")
    return problems


@pytest.fixture(scope="module")
def doc_texts() -> dict[str, str]:
    names = ["docker/smoke.sh", "docker/README.md", "docker/Dockerfile", "cluster/README.md"]
    return {n: (ROOT / n).read_text() for n in names}


def test_smoke_command_is_the_same_everywhere(doc_texts):
    assert smoke_command_problems(doc_texts) == []
    script = doc_texts["docker/smoke.sh"]
    assert "set -euo pipefail" in script  # a failing step fails the build / the docker run
    assert subprocess.run(["bash", "-n", str(DOCKER / "smoke.sh")]).returncode == 0


def test_diverging_smoke_command_is_rejected(doc_texts):
    readme = copy.copy(doc_texts)
    readme["docker/README.md"] = readme["docker/README.md"].replace(SMOKE_CMD, "python -m qed_ray.envs --check")
    assert any("docker/README.md" in p for p in smoke_command_problems(readme))
    script = copy.copy(doc_texts)
    script["docker/smoke.sh"] = script["docker/smoke.sh"].replace(SMOKE_CMD, "python -m qed_ray.envs --list")
    assert any("must run exactly" in p for p in smoke_command_problems(script))


def image_tag_problems(images_by_file: dict[str, list[str]], documented: dict[str, str]) -> list[str]:
    problems = []
    allowed = set(documented.values())
    for name, images in images_by_file.items():
        for image in images:
            if image not in allowed:
                problems.append(f"{name}: image {image!r} is not documented in docker/README.md")
            tag = image.rsplit(":", 1)[-1]
            if not tag.startswith(ray.__version__ + "-"):
                problems.append(f"{name}: image {image!r} is not built on ray {ray.__version__}")
    return problems


def collect_images() -> dict[str, list[str]]:
    images = {n: [load_yaml(p)["docker"]["image"]] for n, p in LAUNCHERS.items()}
    cr = load_docs(CLUSTER / "kuberay.yaml")["RayCluster"]
    images["kuberay"] = [c["image"] for _, c, _ in ray_containers(cr)]
    dep = load_docs(CLUSTER / "kuberay-mlflow.yaml")["Deployment"]
    images["kuberay-mlflow"] = [c["image"] for c in dep["spec"]["template"]["spec"]["containers"]]
    images["cluster/README.md"] = IMAGE_RE.findall((CLUSTER / "README.md").read_text())
    return images


def test_cluster_configs_use_the_documented_image(documented_images):
    images = collect_images()
    assert image_tag_problems(images, documented_images) == []
    # Every Ray node runs the GPU image; only the MLflow server uses the CPU variant.
    for name in ("aws", "gcp", "kuberay"):
        assert set(images[name]) == {documented_images["gpu"]}, name
    assert images["kuberay-mlflow"] == [documented_images["cpu"]]
    # The documented tags are the Dockerfile's BASE_TAG variants.
    base_tag = Dockerfile.parse((DOCKER / "Dockerfile").read_text()).arg_default("BASE_TAG")
    assert documented_images["gpu"].endswith(":" + base_tag)


def test_undocumented_image_tag_is_rejected(documented_images):
    images = collect_images()
    images["gcp"] = ["ghcr.io/your-org/qed-ray:2.59.0-py311-gpu"]
    problems = image_tag_problems(images, documented_images)
    assert any("gcp" in p and "not documented" in p for p in problems)
    assert any("gcp" in p and "not built on ray" in p for p in problems)


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    patterns = {ln.strip().rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", "results", "mlruns", "*.db"} <= patterns
    assert "docker" not in patterns  # docker/smoke.sh must be in the context
