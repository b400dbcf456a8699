"""What every check shares: the repository's layout, pyproject.toml's pins, YAML loading, path and shell helpers."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

LAUNCHERS = {"aws": "cluster/aws.yaml", "gcp": "cluster/gcp.yaml"}
KUBERAY, KUBERAY_MLFLOW = "cluster/kuberay.yaml", "cluster/kuberay-mlflow.yaml"
KUBERAY_NAMESPACE = "cluster/kuberay-namespace.yaml"  # the namespace, with its Pod Security Admission level
CLUSTER_README = "cluster/README.md"
IAM_DIR = "cluster/iam"
FILESTORE_FLAGS = "cluster/gcp-filestore.yaml"
DOCKERFILE, DOCKER_README, SMOKE_SCRIPT = "docker/Dockerfile", "docker/README.md", "docker/smoke.sh"
CONSTRAINTS = "docker/constraints.txt"
# MLflow artifacts go to the provider's object store (through the tracking server).
STORAGE_SCHEME = {"aws": "s3", "gcp": "gs"}
# Sweep results must be on a shared POSIX file system (the sweep refuses s3:// and gs:// storage paths:
# snapshots, replay chunks, DONE markers and sweep.json are plain files every node reads and writes),
# mounted at this path on every node: EFS (AWS), Filestore (GCP), a ReadWriteMany volume (KubeRay).
SHARED_MOUNT = PurePosixPath("/mnt/qed")
STORAGE_PATH = SHARED_MOUNT / "sweeps"
# The image's non-root user, who must be able to write the storage folder.
RAY_UID = "1000"
# On the VM heads the MLflow server's admin login (and session secret) is generated into this owner-only file at its
# first start and read by the server alone; the nodes' clients log in with ~/.qed/mlflow.env as a non-admin user that
# cluster/mlflow_users.py creates (the image holds the repository at ~/qed-ray, docker/Dockerfile's WORKDIR).
MLFLOW_ADMIN_ENV = "~/mlflow/admin.env"
MLFLOW_CLIENT_ENV = "~/.qed/mlflow.env"
MLFLOW_USERS_TOOL = "~/qed-ray/cluster/mlflow_users.py"
# qed-ray envs (qed_ray.rl.envs) loads all 18 tasks, one line per task: the image's smoke test.
SMOKE_CMD = "qed-ray envs --check-all"
# Any image reference of the project's image, whatever registry replaces the placeholder.
IMAGE_RE = re.compile(r"[\w.\-]+(?:/[\w.\-]+)*/qed-ray:[\w.\-]+(?:@sha256:[0-9a-f]{64})?")
# An exact version tag: <ray version>-py3XX-<variant>, optionally pinned further by digest. Never `latest`
# or a floating series such as `2.60-gpu`.
EXACT_TAG_RE = re.compile(r"\d+\.\d+\.\d+-py3\d+-(gpu|cpu)(@sha256:[0-9a-f]{64})?")


def image_name_tag(reference: str) -> str:
    """``qed-ray:<tag>`` of an image reference, without its registry (docker/README.md's is a placeholder that
    cluster/fill.py replaces) or digest."""
    return reference.split("@")[0].rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Pins:
    """The version pins the image and the clusters must agree with."""

    specs: dict[str, SpecifierSet]  # canonical name -> specifier, runtime dependencies only
    ray_series: str  # "2.60" from ray[tune,default]>=2.60,<2.61
    python_min: Version  # from requires-python
    makefile_torch: str | None  # the torch pin the Makefile installs, if any


def load_pins(root: Path) -> Pins:
    """Reads pyproject.toml (and the Makefile's torch pin) under ``root``."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    specs = {}
    for dep in project["dependencies"]:
        req = Requirement(dep)
        specs[canonicalize_name(req.name)] = req.specifier
    lower = [Version(s.version) for s in specs["ray"] if s.operator in (">=", "==", "~=")]
    if not lower:
        raise ValueError("pyproject.toml: ray needs a lower bound to define its series")
    python_min = Version(re.search(r">=\s*([\d.]+)", project["requires-python"]).group(1))
    makefile = root / "Makefile"
    m = re.search(r"torch==([\w.+]+)", makefile.read_text()) if makefile.exists() else None
    return Pins(specs, f"{lower[0].major}.{lower[0].minor}", python_min, m.group(1) if m else None)


def load_yaml(path: Path) -> dict:
    """One YAML document (safe loader)."""
    return yaml.safe_load(path.read_text())


def load_docs(path: Path) -> list[dict]:
    """The non-empty documents of a multi-document manifest."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    """The documents of one kind."""
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict], kind: str) -> dict | None:
    """The only document of ``kind`` (None if there is none or several)."""
    found = of_kind(docs, kind)
    return found[0] if len(found) == 1 else None


def is_under(path: str | PurePosixPath, root: str | PurePosixPath) -> bool:
    """An absolute POSIX path at or below root (no URIs, no relative paths, no '..')."""
    path = PurePosixPath(path)
    return path.is_absolute() and ".." not in path.parts and path.is_relative_to(root)


def command_flags(text: str, program: tuple[str, ...]) -> dict[str, str | bool] | None:
    """The ``--flag value`` / ``--flag=value`` options of the first ``program`` (e.g. ``("mlflow", "server")``)
    in a shell text, up to the next shell operator; None if the program is not run there."""
    tokens = shlex.split(text, comments=False, posix=True)
    for i in range(len(tokens) - len(program) + 1):
        if tuple(tokens[i:i + len(program)]) == program:
            flags: dict[str, str | bool] = {}
            rest = tokens[i + len(program):]
            j = 0
            while j < len(rest) and rest[j] not in ("&&", "||", ";", "|", "&", ">", "<", "2>&1"):
                tok = rest[j]
                if tok.startswith("--"):
                    key, eq, value = tok[2:].partition("=")
                    if eq:
                        flags[key] = value
                    elif j + 1 < len(rest) and not rest[j + 1].startswith("-") and rest[j + 1] not in (">", "&"):
                        flags[key] = rest[j + 1]
                        j += 1
                    else:
                        flags[key] = True
                j += 1
            return flags
    return None
