"""The image recipe (docker/Dockerfile, docker/constraints.txt, docker/smoke.sh) and the image references of every
cluster config."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import ray
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .common import (DOCKER_README, EXACT_TAG_RE, IMAGE_RE, KUBERAY, KUBERAY_MLFLOW, LAUNCHERS, SMOKE_CMD, Pins,
                     image_name_tag, load_docs, load_yaml, one)

EXACT_PINS = ("ray", "torch", "mujoco", "dm-control", "mlflow")
HEADLESS_APT = ("libegl1", "libgl1", "libglvnd0", "libopengl0", "libosmesa6")
PIP_VALUE_FLAGS = {"--index-url", "-i", "--extra-index-url", "-c", "--constraint", "-r", "--requirement", "-f",
                   "--find-links", "--target", "-t"}


@dataclass
class Dockerfile:
    """A Dockerfile as (KEYWORD, arguments) instructions, continuation lines joined, comments dropped."""

    instructions: list[tuple[str, str]]

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

    def pip_installs(self) -> list[tuple[list[str], list[Requirement]]]:
        """(options, requirement specifiers) of every `pip install` in RUN instructions."""
        installs = []
        for run in self.args_of("RUN"):
            tokens = shlex.split(run)
            i = 0
            while i < len(tokens):
                if tokens[i] == "pip" and i + 1 < len(tokens) and tokens[i + 1] == "install":
                    opts, reqs, i = [], [], i + 2
                    while i < len(tokens) and tokens[i] not in ("&&", "||", ";", "|"):
                        tok = tokens[i]
                        if tok in PIP_VALUE_FLAGS and i + 1 < len(tokens):
                            opts += [tok, tokens[i + 1]]
                            i += 2
                            continue
                        if tok.startswith("-"):
                            opts.append(tok)
                        elif tok not in (".", "./") and "$" not in tok:
                            reqs.append(Requirement(tok))
                        i += 1
                    installs.append((opts, reqs))
                i += 1
        return installs

    def pip_requirements(self) -> list[Requirement]:
        """Requirement specifiers passed to `pip install` in RUN instructions."""
        return [r for _, reqs in self.pip_installs() for r in reqs]


def _base_problems(df: Dockerfile, pins: Pins) -> tuple[list[str], str | None]:
    problems = []
    base_image = df.arg_default("BASE_IMAGE") or ""
    froms = df.args_of("FROM")
    if not froms or not froms[0].startswith("${BASE_IMAGE}") or base_image != "rayproject/ray:${BASE_TAG}":
        problems.append("the first FROM must be ${BASE_IMAGE}, whose default is rayproject/ray:${BASE_TAG} "
                        "(docker/build.sh passes the digest-pinned reference)")
    m = re.fullmatch(r"(\d+\.\d+\.\d+)-py3(\d+)-(gpu|cpu|cu\d+)", df.arg_default("BASE_TAG") or "")
    if not m:
        return problems + [f"ARG BASE_TAG default {df.arg_default('BASE_TAG')!r} is not <ray>-py3XX-gpu"], None
    base_ray, py_minor, _ = m.groups()
    if not base_ray.startswith(pins.ray_series + ".") or base_ray != ray.__version__:
        problems.append(f"BASE_TAG ray {base_ray} is not the pinned/installed ray {pins.ray_series}.x / "
                        f"{ray.__version__}")
    if Version(f"3.{py_minor}") < pins.python_min:
        problems.append(f"BASE_TAG python 3.{py_minor} is below requires-python {pins.python_min}")
    return problems, base_ray


def _pin_problems(df: Dockerfile, pins: Pins, base_ray: str | None) -> list[str]:
    problems, reqs = [], {}
    for req in df.pip_requirements():
        reqs.setdefault(canonicalize_name(req.name), []).append(req)
    for name in pins.specs:
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
    if not {"tune", "default"} <= {e for r in reqs.get("ray", []) for e in r.extras}:
        problems.append("ray must be installed with the [tune,default] extras")
    return problems


def _runtime_problems(df: Dockerfile) -> list[str]:
    problems, env = [], df.env()
    if env.get("MUJOCO_GL") != "egl":
        problems.append(f"ENV MUJOCO_GL must be egl, got {env.get('MUJOCO_GL')!r}")
    if not ({"graphics", "all"} & set(env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(","))):
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


def check_dockerfile(text: str, pins: Pins) -> list[str]:
    """Image recipe vs pyproject.toml pins and the runtime requirements of the cluster."""
    df = Dockerfile.parse(text)
    problems, base_ray = _base_problems(df, pins)
    return problems + _pin_problems(df, pins, base_ray) + _runtime_problems(df)


def smoke_command_problems(texts: dict[str, str]) -> list[str]:
    """smoke.sh must run SMOKE_CMD; every mention of qed-ray envs elsewhere must be that string."""
    problems = []
    runs = [ln.strip() for ln in texts.get("docker/smoke.sh", "").splitlines()
            if "qed-ray envs" in ln and not ln.strip().startswith("#")]
    if runs != [SMOKE_CMD]:
        problems.append(f"docker/smoke.sh must run exactly {SMOKE_CMD!r}, runs {runs}")
    if SMOKE_CMD not in texts.get("docker/README.md", ""):
        problems.append(f"docker/README.md does not document {SMOKE_CMD!r}")
    for name, text in texts.items():
        for mention in re.findall(r"qed-ray envs[^\n`'\"]*", text):
            if mention.strip() != SMOKE_CMD:
                problems.append(f"{name}: {mention.strip()!r} differs from {SMOKE_CMD!r}")
    return problems


def documented_images(root: Path) -> dict[str, str]:
    """The image tags docker/README.md documents, keyed by variant (gpu/cpu)."""
    tags = set(IMAGE_RE.findall((root / DOCKER_README).read_text()))
    return {t.split("@")[0].rsplit("-", 1)[-1]: t for t in tags}


def collect_images(root: Path, configs: Path | None = None) -> dict[str, list[str]]:
    """Every image reference of the cluster configs (in ``configs``, default ``root/cluster``) and the cluster README,
    by file."""
    from .kuberay import pod_specs

    configs = root / "cluster" if configs is None else configs
    images = {n: [load_yaml(configs / Path(p).name)["docker"]["image"]] for n, p in LAUNCHERS.items()}
    cr = one(load_docs(configs / Path(KUBERAY).name), "RayCluster")
    images["kuberay"] = [c["image"] for _, pod in pod_specs(cr)
                         for c in pod.get("containers", []) + pod.get("initContainers", [])]
    dep = one(load_docs(configs / Path(KUBERAY_MLFLOW).name), "Deployment")
    images["kuberay-mlflow"] = [c["image"] for c in dep["spec"]["template"]["spec"]["containers"]]
    images["cluster/README.md"] = IMAGE_RE.findall((root / "cluster/README.md").read_text())
    return images


def image_tag_problems(images_by_file: dict[str, list[str]], documented: dict[str, str]) -> list[str]:
    """Every reference is a documented image and tag (in the configs' one registry: docker/README.md's is a
    placeholder), built on the installed Ray, by exact version tag (or digest)."""
    problems, allowed = [], {image_name_tag(t) for t in documented.values()}
    registries = {i.rsplit("/", 1)[0] for n, images in images_by_file.items() if n != "cluster/README.md"
                  for i in images}
    if len(registries) > 1:
        problems.append(f"the configs pull from more than one registry: {sorted(registries)}")
    for name, images in images_by_file.items():
        for image in images:
            repo_tag = image.split("@")[0]
            tag = repo_tag.rsplit(":", 1)[-1]
            if image_name_tag(image) not in allowed:
                problems.append(f"{name}: image {image!r} is not documented in docker/README.md")
            digest = "@" + image.split("@", 1)[1] if "@" in image else ""
            if not EXACT_TAG_RE.fullmatch(tag + digest):
                problems.append(f"{name}: image {image!r} is not an exact version tag "
                                f"(<ray>-py3XX-gpu|cpu, optionally @sha256:<digest>)")
            if not tag.startswith(ray.__version__ + "-"):
                problems.append(f"{name}: image {image!r} is not built on ray {ray.__version__}")
    return problems
