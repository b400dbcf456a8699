"""What goes into the image and into job uploads: exact pins for every pip install, no passwordless sudo, and the
ignore files that keep secrets out of the Docker build context and of `ray job submit --working-dir .`."""

from __future__ import annotations

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .common import CONSTRAINTS, Pins
from .image import Dockerfile

# Both ignore files must keep these out (.dockerignore with `**/`: Docker matches a bare pattern at the top only).
SECRET_PATTERNS = (".env", "*.env", "auth_token", "*.token", "*.pem", "*.key", "*credentials*", ".aws/",
                   ".config/gcloud/", ".kube/", ".ssh/", ".pgpass", ".qed/", ".netrc", "*.pfx", "*secret*", "id_rsa*",
                   "id_ecdsa*", "id_ed25519*", ".pypirc", ".docker/", ".config/qed_ray/")


def constraint_pins(text: str) -> dict[str, str]:
    """name -> exact version of a constraints file (every line must be `name==version`)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            exact = [s.version for s in req.specifier if s.operator == "=="]
            pins[canonicalize_name(req.name)] = exact[0] if len(exact) == 1 and len(req.specifier) == 1 else ""
    return pins


def constraints_problems(dockerfile: str, constraints: str, pins: Pins) -> list[str]:
    """Every `pip install` uses the constraints file, which pins every package the Dockerfile names exactly, within
    the Dockerfile's and pyproject's specifiers."""
    problems, exact = [], constraint_pins(constraints)
    problems += [f"{CONSTRAINTS}: {name} is not pinned with == (exact versions only)"
                 for name, version in exact.items() if not version]
    for opts, reqs in Dockerfile.parse(dockerfile).pip_installs():
        if not any(o in ("-c", "--constraint") for o in opts):
            problems.append(f"pip install {' '.join(str(r) for r in reqs)}: needs -c {CONSTRAINTS}")
        for req in reqs:
            name, version = canonicalize_name(req.name), exact.get(canonicalize_name(req.name))
            if not version:
                problems.append(f"{req.name} is installed but not pinned in {CONSTRAINTS}")
            elif Version(version) not in req.specifier or (name in pins.specs and Version(version) not in
                                                             pins.specs[name]):
                problems.append(f"{CONSTRAINTS}: {name}=={version} violates {req} or pyproject")
    return problems


def sudo_problems(dockerfile: str, smoke: str) -> list[str]:
    """The image's user gets no passwordless sudo (the Ray base image grants it), checked at build and in smoke."""
    runs = Dockerfile.parse(dockerfile).args_of("RUN")
    problems = []
    if not any("sed -i" in r and "NOPASSWD" in r and "/etc/sudoers" in r for r in runs):
        problems.append("the Dockerfile must remove the base image's NOPASSWD sudo rule (/etc/sudoers)")
    if "sudo -n true" not in smoke:
        problems.append("docker/smoke.sh must fail when `sudo -n true` succeeds")
    return problems


def ignore_problems(rayignore: str, dockerignore: str) -> list[str]:
    """Both ignore files list every secret pattern."""
    problems = []
    for name, text, prefix in ((".rayignore", rayignore, ""), (".dockerignore", dockerignore, "**/")):
        lines = {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")}
        missing = [p for p in SECRET_PATTERNS if p not in lines and prefix + p not in lines]
        if missing:
            problems.append(f"{name}: secrets not excluded: {missing}")
    return problems
