"""The cluster pre-flight check (cluster/check.py, package cluster/preflight/) on the shipped files and on broken
copies, and the behaviour of the configs' shell commands against stub host tools.

No cloud credentials, no Docker engine and no Kubernetes are needed: the launcher YAMLs go through Ray's own
validators, the KubeRay CR through Ray's KubeRay-to-autoscaler conversion, everything else through the project's
checks, which read the pins from pyproject.toml. Trust-boundary rules: tests/cluster/test_cluster_trust.py.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cluster"))

from preflight import run_all  # noqa: E402
from preflight.common import (KUBERAY, KUBERAY_MLFLOW, LAUNCHERS, RAY_UID, SHARED_MOUNT, SMOKE_CMD,  # noqa: E402
                              STORAGE_PATH, load_docs, load_pins, load_yaml, one)
from preflight.image import (Dockerfile, check_dockerfile, collect_images, documented_images,  # noqa: E402
                             image_tag_problems, smoke_command_problems)
from preflight.kuberay import (check_kuberay, mlflow_reachability_problems, ray_containers,  # noqa: E402
                               shared_volume_problems, storage_claim)
from preflight.launcher import (NFS_MOUNT_RE, all_shell_commands, bash_syntax_errors, check_launcher,  # noqa: E402
                                node_init_commands, ray_validate)

PROVIDERS = sorted(LAUNCHERS)


@pytest.fixture(autouse=True)
def no_cloud_env(monkeypatch):
    """Nothing here may reach a cloud: drop credentials/profiles that could change behaviour."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "GOOGLE_", "CLOUDSDK_", "KUBECONFIG")):
            monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def pins():
    return load_pins(ROOT)


@pytest.fixture(scope="module")
def documented() -> dict[str, str]:
    return documented_images(ROOT)


def launcher(provider: str) -> dict:
    return load_yaml(ROOT / LAUNCHERS[provider])


# ---- the check as a whole ---------------------------------------------------------------------------------------
def test_pins_are_parsed_from_pyproject(pins):
    assert pins.ray_series == "2.60"
    assert Version(ray.__version__) in pins.specs["ray"]
    assert ray.__version__.startswith(pins.ray_series + ".")


def test_every_check_passes_on_the_shipped_files():
    results = run_all(ROOT)
    assert set(results) == {"cluster/aws.yaml", "cluster/gcp.yaml", f"{KUBERAY} + {KUBERAY_MLFLOW}",
                            "docker/Dockerfile + image references", ".rayignore + .dockerignore"}
    assert results == {section: [] for section in results}


def _checkout_copy(tmp_path: Path) -> Path:
    """The files the check reads, copied into a scratch checkout."""
    for name in ("pyproject.toml", "Makefile", ".rayignore", ".dockerignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("cluster", "docker"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_cli_template_passes_here_and_names_the_problem_of_a_broken_copy(tmp_path):
    """--template: the shipped templates' structure (placeholders allowed; test_cluster_fill.py: without it)."""
    ok = subprocess.run([sys.executable, str(ROOT / "cluster" / "check.py"), "--template"], capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip().splitlines()[0] == "checking cluster/ (the shipped templates: their structure only)"
    assert ok.stdout.strip().splitlines()[-1] == "all checks passed"
    broken = _checkout_copy(tmp_path)
    aws = broken / "cluster" / "aws.yaml"
    aws.write_text(aws.read_text().replace("instance-profile/qed-ray-worker", "instance-profile/qed-ray-head"))
    proc = subprocess.run([sys.executable, str(ROOT / "cluster" / "check.py"), "--template", "--root", str(broken)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL cluster/aws.yaml" in proc.stdout and "ok   cluster/gcp.yaml" in proc.stdout
    # The workers on the head's profile: named as such, and the head's PassRole / the EFS policy no longer fit.
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("     - ")] == [
        "     - qed-ray-head: iam:PassRole only on the workers' role ['qed-ray-head'], got "
        "['arn:aws:iam::123456789012:role/qed-ray-worker']",
        "     - workers must not use the head's or Ray's profile 'qed-ray-head': trial code could launch instances "
        "and write buckets",
        "     - EFS policy: allows ['qed-ray-worker']; only the cluster's roles"]
    assert proc.stdout.strip().splitlines()[-1] == "3 problem(s)"
    assert "INFO" not in proc.stderr


@pytest.mark.parametrize("edit, expected", [
    (lambda d: (d / "cluster" / "gcp.yaml").write_text("cluster_name: [unclosed\n"),  # read by two sections
     {"cluster/gcp.yaml": ["cannot check: ParserError: while parsing a flow sequence"],
      "docker/Dockerfile + image references": ["cannot check: ParserError: while parsing a flow sequence"]}),
    (lambda d: (d / "cluster" / "iam" / "aws-efs-policy.json").unlink(),
     {"cluster/aws.yaml": ["aws-efs-policy.json: the EFS file system policy is missing"]}),
    (lambda d: (d / "cluster" / "kuberay.yaml").write_text((d / "cluster" / "kuberay.yaml").read_text().replace(
        "  namespace: qed\nspec:\n  # Must equal", "spec:\n  # Must equal")),
     {f"{KUBERAY} + {KUBERAY_MLFLOW}": ["KubeRay-to-autoscaler conversion: KeyError: 'namespace'"]}),
])
def test_malformed_inputs_give_one_line_problems_not_tracebacks(tmp_path, edit, expected):
    root = _checkout_copy(tmp_path)
    edit(root)
    assert {section: problems for section, problems in run_all(root).items() if problems} == expected


# ---- Ray cluster launcher configs (aws.yaml, gcp.yaml) ----------------------------------------------------------
@pytest.mark.parametrize("provider", PROVIDERS)
def test_launcher_config_passes_ray_validation(provider):
    prepared = ray_validate(launcher(provider))
    # prepare_config merged the provider defaults: our explicit command lists must have won
    # (otherwise the defaults' `pip install ray-nightly` setup command would run on the nodes).
    assert not any("pip install" in c for c in prepared["head_setup_commands"] + prepared["worker_setup_commands"])
    assert prepared["available_node_types"][prepared["head_node_type"]]["max_workers"] == 0


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


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name,mutate,exc,message", RAY_REJECTS, ids=[r[0] for r in RAY_REJECTS])
def test_broken_launcher_config_is_rejected_by_ray(provider, name, mutate, exc, message):
    cfg = launcher(provider)
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
        NFS_MOUNT_RE.sub(lambda m: m.group(0).replace(m.group(3), m.group(3).replace(":", "-other:", 1)), c)
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
                                                   _without_mount), "gpu_worker: no `mount -t nfs|efs"),
    ("head without the shared mount", _edit_list("initialization_commands", _without_mount),
     "head: no `mount -t nfs|efs"),
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


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("name,mutate,message", PROJECT_REJECTS, ids=[r[0] for r in PROJECT_REJECTS])
def test_broken_launcher_config_is_rejected_by_project_checks(provider, name, mutate, message, documented):
    cfg = launcher(provider)
    assert check_launcher(cfg, provider, documented["gpu"]) == []
    mutate(cfg)
    problems = check_launcher(cfg, provider, documented["gpu"])
    assert any(message in p for p in problems), problems


@pytest.mark.parametrize("provider", PROVIDERS)
def test_launcher_shell_commands_are_valid_bash(provider):
    cmds = all_shell_commands(launcher(provider))
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
    "chmod": 'echo "chmod $*" >> "$STATE/log"',
    "apt-get": 'echo "apt-get $*" >> "$STATE/log"',
    "dnf": 'echo "dnf $*" >> "$STATE/log"',
}
CLIENT_PACKAGE = {"aws": "amazon-efs-utils", "gcp": "nfs-common"}


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


@pytest.mark.parametrize("provider", PROVIDERS)
def test_shared_mount_commands_are_idempotent_and_fail_loudly(provider, tmp_path):
    """Run each node type's host commands twice against stub host tools (a fresh host without the NFS/EFS client):
    one install, one mount; the head hands the sweeps folder to the ray user, closed to others, the root-squashed
    workers do not try; and a failed mount fails the command (so `ray up` stops) instead of leaving results on the
    node's local disk."""
    cfg = launcher(provider)
    for name, cmds in node_init_commands(cfg).items():
        assert len([c for c in cmds if NFS_MOUNT_RE.search(c)]) == 1, f"{name}: expected one mount command"
        cmds = [c for c in cmds if NFS_MOUNT_RE.search(c) or str(STORAGE_PATH) in c]  # not the driver wait
        host = tmp_path / name
        host.mkdir()
        rcs, log = _run_host_commands(cmds * 2, host)
        assert rcs == [0] * 2 * len(cmds), log
        mounts = [line for line in log if line.startswith("mount ")]
        assert len(mounts) == 1 and mounts[0].split()[-1] == str(SHARED_MOUNT), log
        assert re.match(r"mount -t (nfs4?|efs) ", mounts[0])
        assert sum("install" in line and CLIENT_PACKAGE[provider] in line for line in log) == 1, log
        assert log.index(f"mkdir -p {SHARED_MOUNT}") < log.index(mounts[0])
        prepared = [log.count(f"chown {RAY_UID}:100 {STORAGE_PATH}"), log.count(f"chmod 750 {STORAGE_PATH}")]
        assert prepared == ([2, 2] if name == cfg["head_node_type"] else [0, 0]), log  # on every `ray up`

        failing = tmp_path / f"{name}-fails"
        failing.mkdir()
        mount_cmd = [c for c in cmds if NFS_MOUNT_RE.search(c)]
        rcs, log = _run_host_commands(mount_cmd, failing, MOUNT_FAILS="1")
        assert rcs[0] != 0, log


def _run_setup(cfg: dict, home: Path, extra_env: dict[str, str]) -> dict[str, str]:
    """Run the config's setup_commands in a scratch HOME holding the two files file_mounts copies (world-readable,
    as a careless copy would be), then report what a fresh shell that sources ~/qed_env.sh sees (exactly what
    `ray start` inherits)."""
    for path, text in ((".ray/auth_token", "f" * 64), (".qed/mlflow.env",
                                                       "MLFLOW_TRACKING_USERNAME=qed\nMLFLOW_TRACKING_PASSWORD=s3cr3t\n")):
        (home / path).parent.mkdir(exist_ok=True)
        (home / path).write_text(text)
        (home / path).chmod(0o644)
    env = {"HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           **extra_env}
    for cmd in cfg["setup_commands"]:
        subprocess.run(["bash", "-c", cmd], env=env, check=True, timeout=120)
    names = ("MLFLOW_TRACKING_URI", "QED_STORAGE_PATH", "RAY_AUTH_MODE", "QED_MLFLOW_BACKEND_STORE_URI",
             "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    out = subprocess.run(["bash", "-c", "source ~/qed_env.sh && " + " && ".join(f'echo "{n}=${n}"' for n in names)],
                         env={"HOME": str(home), "PATH": os.environ["PATH"]},
                         capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines())


@pytest.mark.parametrize("provider", PROVIDERS)
def test_setup_commands_give_workers_the_head_tracking_uri_and_private_secrets(provider, tmp_path):
    cfg = ray_validate(launcher(provider))
    # On workers the autoscaler exports RAY_HEAD_IP to setup commands.
    seen = _run_setup(cfg, tmp_path, {"RAY_HEAD_IP": "10.1.2.3"})
    assert seen["MLFLOW_TRACKING_URI"] == "http://10.1.2.3:5000"
    assert seen["QED_STORAGE_PATH"] == str(STORAGE_PATH)
    assert seen["RAY_AUTH_MODE"] == "token"
    assert seen["QED_MLFLOW_BACKEND_STORE_URI"].startswith("sqlite:////")  # absolute path
    assert (seen["MLFLOW_TRACKING_USERNAME"], seen["MLFLOW_TRACKING_PASSWORD"]) == ("qed", "s3cr3t")
    assert "s3cr3t" not in (tmp_path / "qed_env.sh").read_text()  # sourced from its file, never copied
    for secret in (".ray/auth_token", ".qed/mlflow.env"):
        assert stat.S_IMODE((tmp_path / secret).stat().st_mode) == 0o600, secret
    # Re-running setup (every `ray up`) must not stack up .bashrc lines.
    _run_setup(cfg, tmp_path, {"RAY_HEAD_IP": "10.1.2.3"})
    assert (tmp_path / ".bashrc").read_text().count("qed_env.sh") == 1


def test_setup_commands_on_head_use_rays_own_node_ip(tmp_path):
    # `ray up` does not export RAY_HEAD_IP on the head: the head asks Ray, the same function the
    # autoscaler uses to tell the workers the head's address, so both sides agree.
    seen = _run_setup(ray_validate(launcher("aws")), tmp_path, {})
    assert seen["MLFLOW_TRACKING_URI"] == f"http://{ray.util.get_node_ip_address()}:5000"


# ---- KubeRay (kuberay.yaml, kuberay-mlflow.yaml) ----------------------------------------------------------------
@pytest.fixture()
def ray_docs() -> list[dict]:
    return load_docs(ROOT / KUBERAY)


@pytest.fixture()
def ray_cr(ray_docs) -> dict:
    return one(ray_docs, "RayCluster")


def test_kuberay_cr_converts_to_a_valid_autoscaler_config(ray_cr):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    from ray.autoscaler._private.util import validate_config

    derived = _derive_autoscaling_config_from_ray_cr(ray_cr)
    validate_config(derived)
    types = derived["available_node_types"]
    assert types.pop(derived["head_node_type"])["resources"]["CPU"] == 0
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) >= 1}
    group = ray_cr["spec"]["workerGroupSpecs"][0]
    assert (gpu[group["groupName"]]["min_workers"], gpu[group["groupName"]]["max_workers"]) == (0, group["maxReplicas"])


def test_kuberay_cr_without_namespace_cannot_be_converted(ray_cr):
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    del ray_cr["metadata"]["namespace"]
    with pytest.raises(KeyError, match="namespace"):
        _derive_autoscaling_config_from_ray_cr(ray_cr)


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
    ("no GPU toleration", lambda cr: _worker_pod(cr).update(tolerations=[]), "toleration"),
]


@pytest.mark.parametrize("name,mutate,message", KUBERAY_BROKEN, ids=[b[0] for b in KUBERAY_BROKEN])
def test_broken_kuberay_cr_is_rejected(ray_cr, pins, name, mutate, message):
    assert check_kuberay(ray_cr, pins) == []
    mutate(ray_cr)
    problems = check_kuberay(ray_cr, pins)
    assert any(message in p for p in problems), problems


def test_kuberay_results_volume_is_shared_by_every_pod(ray_cr, ray_docs):
    assert shared_volume_problems(ray_cr, ray_docs) == []
    claims = {storage_claim(c, pod, str(STORAGE_PATH)) for _, c, pod in ray_containers(ray_cr)}
    assert claims == {(one(ray_docs, "PersistentVolumeClaim")["metadata"]["name"], str(SHARED_MOUNT), "")}
    assert len(ray_containers(ray_cr)) == 1 + len(ray_cr["spec"]["workerGroupSpecs"])


def _worker_mount(cr, **changes):
    _gpu_worker(cr)["volumeMounts"] = [dict(m, **changes) if m["name"] == "results" else m
                                       for m in _gpu_worker(cr)["volumeMounts"]]


def _worker_claim(cr, claim):
    _worker_pod(cr)["volumes"] = [{"name": "results", "persistentVolumeClaim": {"claimName": claim}}
                                  if v["name"] == "results" else v for v in _worker_pod(cr)["volumes"]]


def _claim(docs):
    return one(docs, "PersistentVolumeClaim")


@pytest.mark.parametrize("name,mutate,message", [
    ("worker mounts another claim", lambda cr, d: _worker_claim(cr, "other-results"), "same claim"),
    ("worker mounts a sub folder", lambda cr, d: _worker_mount(cr, subPath="worker"), "same claim"),
    ("worker mounts at another path",
     lambda cr, d: (_worker_mount(cr, mountPath="/data"), _set_env(cr, "QED_STORAGE_PATH", "/data/sweeps")),
     "gpu: does not keep QED_STORAGE_PATH"),
    ("worker without the results volume", lambda cr, d: _worker_mount(cr, name="dshm-typo"),
     "gpu: does not keep QED_STORAGE_PATH"),
    ("claim not in the manifest", lambda cr, d: d.remove(_claim(d)), "is not defined"),
    ("claim is ReadWriteOnce", lambda cr, d: _claim(d)["spec"].update(accessModes=["ReadWriteOnce"]), "ReadWriteMany"),
    ("claim in another namespace", lambda cr, d: _claim(d)["metadata"].update(namespace="default"), "namespace"),
    ("claim without storage class", lambda cr, d: _claim(d)["spec"].pop("storageClassName"), "storageClassName"),
    ("no permissions init container", lambda cr, d: _head_pod(cr).pop("initContainers"), "initContainer"),
    ("init container not root", lambda cr, d: _head_pod(cr)["initContainers"][0].update(securityContext={}),
     "initContainer"),
])
def test_broken_kuberay_results_volume_is_rejected(ray_cr, ray_docs, name, mutate, message):
    mutate(ray_cr, ray_docs)
    problems = shared_volume_problems(ray_cr, ray_docs)
    assert any(message in p for p in problems), problems


def _mlflow_script(m, edit):
    container = one(m, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [edit(a) for a in container["args"]]


@pytest.mark.parametrize("name,mutate,message", [
    ("Host header not allowed",
     lambda m, cr: _mlflow_script(m, lambda a: re.sub(r"--allowed-hosts=\S+", "--allowed-hosts=localhost:*", a)),
     "--allowed-hosts rejects Host"),
    ("URI points elsewhere",
     lambda m, cr: _set_env(cr, "MLFLOW_TRACKING_URI", "http://mlflow.default.svc.cluster.local:5000"),
     "is not the Service"),
    ("selector mismatch", lambda m, cr: one(m, "Service")["spec"].update(selector={"app": "other"}), "selector"),
    ("artifacts on pod disk",
     lambda m, cr: _mlflow_script(m, lambda a: re.sub(r"--artifacts-destination=\S+",
                                                      "--artifacts-destination=/mlartifacts", a)), "object store"),
    ("listens on localhost", lambda m, cr: _mlflow_script(m, lambda a: a.replace("--host=0.0.0.0", "--host=127.0.0.1")),
     "bind 0.0.0.0"),
])
def test_broken_kuberay_tracking_wiring_is_rejected(ray_cr, name, mutate, message):
    manifests = load_docs(ROOT / KUBERAY_MLFLOW)
    assert mlflow_reachability_problems(ray_cr, manifests) == []
    mutate(manifests, ray_cr)
    problems = mlflow_reachability_problems(ray_cr, manifests)
    assert any(message in p for p in problems), problems


# ---- Dockerfile, smoke command, image tags ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def dockerfile_text() -> str:
    return (ROOT / "docker" / "Dockerfile").read_text()


def test_dockerfile_pins_are_the_expected_versions(dockerfile_text, pins):
    assert check_dockerfile(dockerfile_text, pins) == []
    pinned = {canonicalize_name(r.name): str(r.specifier) for r in Dockerfile.parse(dockerfile_text).pip_requirements()}
    assert (pinned["mujoco"], pinned["dm-control"], pinned["mlflow"]) == ("==3.17.0", "==1.0.50", "==3.17.2")
    assert pinned["ray"] == f"=={ray.__version__}"


DOCKERFILE_BROKEN = [
    ("mujoco 4", lambda t: t.replace('"mujoco==3.17.0"', '"mujoco==4.0.0"'), "mujoco==4.0.0 violates"),
    ("dm_control drift", lambda t: t.replace('"dm_control==1.0.50"', '"dm_control==1.0.49"', 1), "dm-control"),
    ("old base image", lambda t: t.replace("BASE_TAG=2.60.0-py311-gpu", "BASE_TAG=2.59.0-py311-gpu"), "BASE_TAG ray 2.59.0"),
    ("base image not overridable", lambda t: t.replace("FROM ${BASE_IMAGE} AS runtime", "FROM rayproject/ray:latest AS runtime"),
     "first FROM must be ${BASE_IMAGE}"),
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


@pytest.fixture(scope="module")
def doc_texts() -> dict[str, str]:
    names = ["docker/smoke.sh", "docker/README.md", "docker/Dockerfile", "cluster/README.md"]
    return {n: (ROOT / n).read_text() for n in names}


def test_smoke_command_is_the_same_everywhere(doc_texts):
    assert smoke_command_problems(doc_texts) == []
    assert "set -euo pipefail" in doc_texts["docker/smoke.sh"]  # a failing step fails the build / the docker run
    assert subprocess.run(["bash", "-n", str(ROOT / "docker" / "smoke.sh")]).returncode == 0


def test_diverging_smoke_command_is_rejected(doc_texts):
    readme = dict(doc_texts, **{"docker/README.md": doc_texts["docker/README.md"].replace(
        SMOKE_CMD, "qed-ray envs --check")})
    assert any("docker/README.md" in p for p in smoke_command_problems(readme))
    script = dict(doc_texts, **{"docker/smoke.sh": doc_texts["docker/smoke.sh"].replace(
        SMOKE_CMD, "qed-ray envs --list")})
    assert any("must run exactly" in p for p in smoke_command_problems(script))


def test_cluster_configs_use_the_documented_exact_image_tags(documented):
    images = collect_images(ROOT)
    assert image_tag_problems(images, documented) == []
    for name in ("aws", "gcp", "kuberay"):  # every Ray node runs the GPU image (the init container too)
        assert set(images[name]) == {documented["gpu"]}, name
    assert images["kuberay-mlflow"] == [documented["cpu"]]
    base_tag = Dockerfile.parse((ROOT / "docker" / "Dockerfile").read_text()).arg_default("BASE_TAG")
    assert documented["gpu"].endswith(":" + base_tag)


@pytest.mark.parametrize("image, messages", [
    ("ghcr.io/your-org/qed-ray:2.59.0-py311-gpu", ["not documented", "not built on ray"]),
    ("ghcr.io/your-org/qed-ray:latest", ["not documented", "not an exact version tag", "not built on ray"]),
    ("ghcr.io/your-org/qed-ray:2.60-gpu", ["not documented", "not an exact version tag", "not built on ray"]),
    ("ghcr.io/your-org/qed-ray:2.60.0-py311-gpu@sha256:" + "a" * 64, []),  # pinned by digest: fine
    ("ghcr.io/your-org/qed-ray:2.60.0-py311-gpu@sha256:abc", ["not an exact version tag"]),
])
def test_image_references_must_be_documented_exact_tags(documented, image, messages):
    images = copy.deepcopy(collect_images(ROOT))
    images["gcp"] = [image]
    problems = image_tag_problems(images, documented)
    assert all(p.startswith(f"gcp: image {image!r}") for p in problems), problems
    assert [m for m in messages if not any(m in p for p in problems)] == [], problems
    assert len(problems) == len(messages)


# ---- the dmc18 packs on the shipped clusters' workers (cluster/prices.yaml, qed_ray.service.plan.machines) -----------


def _worker_types(cfg: dict) -> list[dict]:
    return [t["resources"] for name, t in cfg["available_node_types"].items() if name != cfg["head_node_type"]]


@pytest.mark.parametrize("provider", ["aws", "gcp", "kuberay"])
def test_the_dmc18_packs_fit_the_worker_nodes_cpus_gpu_share_and_memory_at_their_auto_size(provider):
    from qed_ray.service.plan.dry_plan import fit_problem, size_packs
    from qed_ray.service.plan.machines import clusters, load_prices
    from qed_ray.service.packing import form_packs
    from qed_ray.spec.sweep import load_spec

    spec = load_spec(ROOT / "sweeps" / "dmc18.yaml")
    need, per_gpu = spec.sized(30).trial_resources(), round(1 / spec.resources.gpu)
    assert (spec.pack.seeds, spec.pack.by) == ("auto", "shape") and per_gpu * spec.resources.gpu == pytest.approx(1.0)
    model = next(m for m in clusters(load_prices()) if m.name == provider)  # the plan's machine is the config's
    if provider != "kuberay":
        (node,) = _worker_types(launcher(provider))
        assert (model.cpus, model.gpus) == (node["CPU"], node["GPU"]) and model.node in str(launcher(provider))
    assert need["cpu"] * per_gpu * model.gpus <= model.cpus, "every pack on a node gets its CPUs"
    # The largest pack that fits with its headroom (qed_ray.service.plan.dry_plan): gcp's 59.6 GiB and KubeRay's 40 GiB
    # (56 Gi less the 16 Gi /dev/shm) cannot hold two MAD-SAC QED packs of 30 on quadruped (19 GiB of replay each on
    # the host), so their packs are smaller there; every pack at that size fits.
    size, packs, how = size_packs(spec, form_packs(spec, size=10**6), model, False)
    assert how == "auto" and size == {"aws": 30, "gcp": 15, "kuberay": 15}[provider]
    assert all(fit_problem(spec.sized(size), p, model) is None for p in packs)


def test_the_kuberay_worker_fits_the_dmc18_packs():
    from qed_ray.spec.sweep import load_spec

    spec = load_spec(ROOT / "sweeps" / "dmc18.yaml")
    need, per_gpu = spec.trial_resources(), round(1 / spec.resources.gpu)
    workers = [c for doc in load_docs(ROOT / KUBERAY) if doc.get("kind") == "RayCluster"
               for g in doc["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]]
    assert workers
    for c in workers:
        requests = c["resources"]["requests"]
        gpus = int(requests["nvidia.com/gpu"])
        assert need["cpu"] * per_gpu * gpus <= float(requests["cpu"]), c["name"]
