"""The placeholders of the shipped cluster configs: one table, the scan that finds them and the fill-in that replaces
them (python cluster/fill.py writes the filled-in copies into cluster/filled/; python cluster/check.py names what is
left). No Ray import: the fill-in answers at once.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .common import FILESTORE_FLAGS, IAM_DIR, KUBERAY, KUBERAY_MLFLOW, KUBERAY_NAMESPACE, LAUNCHERS

TEMPLATES = "cluster"  # the shipped templates (never written by the fill-in)
FILLED = "cluster/filled"  # the filled-in copies (ignored by git): what `ray up` / `kubectl apply` launch
VALUES = "cluster/values.env"  # the user's values (ignored by git), from cluster/values.env.example
EXAMPLE = "cluster/values.env.example"


@dataclass(frozen=True)
class Placeholder:
    """A text of the shipped configs that stands for a value of the user's."""

    token: str  # as it stands in the templates
    variable: str  # the env file's name for its value
    what: str  # what to put there
    pattern: str  # a well-formed value (full match); "ipv4" for an IPv4 address
    example: str  # a well-formed value, for messages

    def problem(self, value: str) -> str | None:
        """Why ``value`` cannot replace this placeholder, as ``VARIABLE=value is ...: put ...`` (None: it can)."""
        if not value:
            why = "is empty"
        elif "REPLACE" in value or any(p.token in value for p in PLACEHOLDERS):
            why = "is itself a placeholder"
        elif self.pattern == "ipv4":
            try:
                ipaddress.IPv4Address(value)
                return None
            except ValueError:
                why = "is not an IPv4 address"
        elif re.fullmatch(self.pattern, value):
            return None
        else:
            why = "is malformed"
        return f"{self.variable}={value} {why}: put {self.what} (e.g. {self.example})"


_AWS_ID = "[0-9a-f]{8}(?:[0-9a-f]{9})?"  # AWS resource ids: 8 or 17 hex digits after the prefix
PLACEHOLDERS = (
    Placeholder("ghcr.io/your-org", "QED_REGISTRY",
                "the registry you pushed the image to with docker/build.sh (REGISTRY=...), without /qed-ray",
                r"(?!.*/qed-ray$)[a-z0-9.-]+(?::[0-9]+)?(?:/[a-z0-9._-]+)*", "ghcr.io/acme-lab"),
    Placeholder("your-qed-bucket", "QED_BUCKET", "the S3 (AWS, EKS) or GCS (GCP, GKE) bucket for MLflow artifacts",
                r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", "acme-qed-artifacts"),
    Placeholder("123456789012", "QED_AWS_ACCOUNT", "your AWS account id (12 digits)", r"[0-9]{12}",
                "210987654321"),
    Placeholder("ami-REPLACE-ME", "QED_AMI",
                "the region's \"Deep Learning Base OSS Nvidia Driver GPU AMI (Amazon Linux 2023)\" (NVIDIA driver, "
                "Docker, the NVIDIA container toolkit; its package manager ships amazon-efs-utils)",
                f"ami-{_AWS_ID}", "ami-0abcdef1234567890"),
    Placeholder("sg-REPLACE-NODES", "QED_NODES_SG",
                "the nodes' security group qed-ray-nodes (AWS one-time setup: $NODES)", f"sg-{_AWS_ID}",
                "sg-0abcdef1234567890"),
    Placeholder("fs-REPLACE-ME", "QED_EFS_ID", "the EFS file system id (AWS one-time setup)", f"fs-{_AWS_ID}",
                "fs-0abcdef1234567890"),
    Placeholder("your-gcp-project", "QED_GCP_PROJECT", "your GCP project id",
                r"[a-z][a-z0-9-]{4,28}[a-z0-9]", "acme-qed"),
    Placeholder("filestore-ip-REPLACE-ME", "QED_FILESTORE_IP",
                "the Filestore instance's IP address (GCP one-time setup)", "ipv4", "10.130.32.2"),
    Placeholder("rwx-class-REPLACE-ME", "QED_STORAGE_CLASS",
                "the ReadWriteMany storage class of the KubeRay volume (an EFS CSI class on EKS, standard-rwx on GKE)",
                r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?", "efs-sc"),
)
BY_VARIABLE = {p.variable: p for p in PLACEHOLDERS}


def target_files(templates: Path) -> dict[str, list[str]]:
    """The config files of each cluster you can launch, relative to the templates' folder."""
    def rel(path: str) -> str:
        return str(Path(path).relative_to(TEMPLATES))

    iam = sorted(templates.joinpath(rel(IAM_DIR)).iterdir())
    return {"aws": [rel(LAUNCHERS["aws"])] + [f"iam/{f.name}" for f in iam if f.name.startswith("aws-")],
            "gcp": [rel(LAUNCHERS["gcp"]), rel(FILESTORE_FLAGS)] + [f"iam/{f.name}" for f in iam
                                                                   if f.name.startswith("gcp-")],
            "kuberay": [rel(KUBERAY_NAMESPACE), rel(KUBERAY), rel(KUBERAY_MLFLOW)]}


@dataclass(frozen=True)
class Found:
    """One placeholder left in a config."""

    path: str  # as given to find_placeholders, joined with the file's name
    line: int
    placeholder: Placeholder

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.placeholder.token} -> {self.placeholder.variable}"


def find_placeholders(folder: Path, shown: str, names: list[str]) -> list[Found]:
    """Every placeholder in the files ``names`` of ``folder`` (shown as ``shown/<name>``): by file, line, table."""
    found = []
    for name in names:
        for number, line in enumerate((folder / name).read_text().splitlines(), start=1):
            found += [Found(f"{shown}/{name}", number, p) for p in PLACEHOLDERS if p.token in line]
    return found


class ValuesError(ValueError):
    """The env file cannot be used; one line per problem, each naming its line."""


def read_values(path: Path, shown: str) -> dict[str, str]:
    """The ``VARIABLE=value`` lines of the env file (``#`` comments and blank lines skipped); every problem at once."""
    values: dict[str, str] = {}
    problems = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line, where = raw.strip(), f"{shown}:{number}"
        if not line or line.startswith("#"):
            continue
        name, eq, value = line.partition("=")
        name, value = name.strip(), value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if not eq:
            problems.append(f"{where}: {line!r} is not a VARIABLE=value line")
        elif name not in BY_VARIABLE:
            close = difflib.get_close_matches(name, list(BY_VARIABLE), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            problems.append(f"{where}: {name} is not one of the variables ({hint}allowed: {', '.join(BY_VARIABLE)})")
        elif name in values:
            problems.append(f"{where}: {name} is set twice")
        elif why := BY_VARIABLE[name].problem(value):
            problems.append(f"{where}: {why}")
        else:
            values[name] = value
    if problems:
        raise ValuesError("\n".join(problems))
    return values


def fill(text: str, values: dict[str, str]) -> str:
    """``text`` with each placeholder whose variable is set replaced by its value."""
    for p in PLACEHOLDERS:
        if p.variable in values:
            text = text.replace(p.token, values[p.variable])
    return text


def out_of_date(templates: Path, copies: Path, shown: str, values: dict[str, str]) -> list[str]:
    """The filled-in copies that are not what the templates and ``values`` give now (missing, or a template or value
    changed since the fill-in), one line each."""
    names = [n for files in target_files(templates).values() for n in files]
    return [f"{shown}/{n}: out of date with {TEMPLATES}/{n} and {VALUES}: run python cluster/fill.py" for n in names
            if not (copies / n).is_file() or (copies / n).read_text() != fill((templates / n).read_text(), values)]


def example_text(templates: Path) -> str:
    """cluster/values.env.example, from the table (tests/cluster/test_cluster_fill.py keeps the file equal)."""
    targets = target_files(templates)
    lines = ["# The values of the cluster configs' placeholders, in one place. Copy this file to cluster/values.env",
             "# (ignored by git), uncomment and set the lines of the cluster you launch, then",
             "#   python cluster/fill.py        # writes the filled-in copies into cluster/filled/ (ignored by git)",
             "#   python cluster/check.py aws   # or gcp / kuberay: names every placeholder left, by file and line",
             "# Plain VARIABLE=value lines; a variable left commented out keeps its placeholder.",
             ""]
    found = {t: {f.placeholder.variable for f in find_placeholders(templates, "", names)}
             for t, names in targets.items()}
    for p in PLACEHOLDERS:
        used = [t for t in targets if p.variable in found[t]]
        about = f"{p.what}, e.g. {p.example} (replaces {p.token}; {', '.join(used)})"
        lines += textwrap.wrap(about, 116, initial_indent="# ", subsequent_indent="#   ",
                               break_on_hyphens=False) + [f"# {p.variable}=", ""]
    return "\n".join(lines)
