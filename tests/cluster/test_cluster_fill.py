"""The placeholders of the cluster configs: cluster/check.py fails while any is left in the configs you launch,
cluster/fill.py fills them in from one env file into cluster/filled/ (the templates untouched). No Ray cluster:
the checks run in-process (Ray's validators only); the structure alone (--template) is tests/cluster/test_cluster.py's.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "cluster"))

import check  # noqa: E402
import fill  # noqa: E402
from preflight.placeholders import PLACEHOLDERS, example_text, read_values  # noqa: E402

VALUES = ROOT / "tests" / "data" / "cluster_values.env"  # a made-up value for every variable


def _run(main, argv: list[str], capsys) -> tuple[int, list[str], list[str]]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def _templates_digest() -> str:
    files = sorted(p for p in (ROOT / "cluster").rglob("*") if p.is_file() and "filled" not in p.parts
                   and "__pycache__" not in p.parts)
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


def test_the_shipped_files_fail_naming_every_placeholder_by_file_and_line(capsys):
    rc, out, _ = _run(check.main, ["--configs", str(ROOT / "cluster")], capsys)
    assert rc == 1
    assert out[:2] == ["checking cluster/", "FAIL placeholders"]
    listed = [ln[len("     - "):] for ln in out if ln.startswith("     - ")]
    assert len(listed) == 47
    assert {"cluster/aws.yaml:45: ghcr.io/your-org -> QED_REGISTRY",
            "cluster/aws.yaml:104: fs-REPLACE-ME -> QED_EFS_ID",
            "cluster/aws.yaml:114: ami-REPLACE-ME -> QED_AMI",
            "cluster/aws.yaml:120: sg-REPLACE-NODES -> QED_NODES_SG",
            "cluster/iam/aws-efs-policy.json:9: 123456789012 -> QED_AWS_ACCOUNT",
            "cluster/iam/aws-efs-policy.json:9: fs-REPLACE-ME -> QED_EFS_ID",
            "cluster/gcp.yaml:99: filestore-ip-REPLACE-ME -> QED_FILESTORE_IP",
            "cluster/kuberay.yaml:109: rwx-class-REPLACE-ME -> QED_STORAGE_CLASS",
            "cluster/kuberay-mlflow.yaml:91: your-qed-bucket -> QED_BUCKET"} <= set(listed)
    # The head's IAM policy: the example account id on 11 lines, the bucket on 2.
    head = [ln for ln in listed if ln.startswith("cluster/iam/aws-qed-ray-head.json:")]
    assert [ln.split(": ", 1)[1] for ln in head] == ["123456789012 -> QED_AWS_ACCOUNT"] * 11 + [
        "your-qed-bucket -> QED_BUCKET"] * 2
    # What to put there, once per variable, then how; the structure itself is fine.
    assert "  QED_AWS_ACCOUNT: your AWS account id (12 digits) (e.g. 210987654321)" in out
    assert sum(ln.startswith("  QED_") for ln in out) == len(PLACEHOLDERS)
    assert out[-2:] == ["fill them in: cp cluster/values.env.example cluster/values.env (if you have none), set the "
                        "variables above there, then python cluster/fill.py", "47 placeholder(s) left"]
    assert [ln for ln in out if ln.startswith("FAIL")] == ["FAIL placeholders"]


def test_only_the_named_clusters_configs_must_be_filled_in(capsys):
    rc, out, _ = _run(check.main, ["kuberay", "--configs", str(ROOT / "cluster")], capsys)
    assert rc == 1
    assert [ln[len("     - "):] for ln in out if ln.startswith("     - ")] == [
        "cluster/kuberay.yaml:109: rwx-class-REPLACE-ME -> QED_STORAGE_CLASS",
        "cluster/kuberay.yaml:173: ghcr.io/your-org -> QED_REGISTRY",
        "cluster/kuberay.yaml:224: ghcr.io/your-org -> QED_REGISTRY",
        "cluster/kuberay.yaml:274: ghcr.io/your-org -> QED_REGISTRY",
        "cluster/kuberay-mlflow.yaml:59: ghcr.io/your-org -> QED_REGISTRY",
        "cluster/kuberay-mlflow.yaml:91: your-qed-bucket -> QED_BUCKET",
        "cluster/kuberay-mlflow.yaml:94: your-qed-bucket -> QED_BUCKET"]
    assert out[-1] == "7 placeholder(s) left"


def test_a_copy_filled_in_from_the_env_file_passes_and_the_templates_stay_untouched(tmp_path, capsys):
    before = _templates_digest()
    out_dir = tmp_path / "filled"
    rc, out, err = _run(fill.main, ["--values", str(VALUES), "--out", str(out_dir)], capsys)
    assert (rc, err) == (0, [])
    assert out == [f"wrote {out_dir}/ from tests/data/cluster_values.env (9 variable(s) set)",
                   "  aws: ready for python cluster/check.py aws", "  gcp: ready for python cluster/check.py gcp",
                   "  kuberay: ready for python cluster/check.py kuberay"]
    assert _templates_digest() == before
    aws = (out_dir / "aws.yaml").read_text()
    assert "image: registry.example.org/acme-lab/qed-ray:2.60.0-py311-gpu" in aws
    assert "arn:aws:iam::210987654321:instance-profile/qed-ray-worker" in aws
    assert '"Resource": "arn:aws:s3:::acme-qed-artifacts/qed-ray/mlflow-artifacts/*"' in (
        out_dir / "iam" / "aws-qed-ray-head.json").read_text()
    rc, out, _ = _run(check.main, ["--configs", str(out_dir)], capsys)
    assert rc == 0, "\n".join(out)
    assert out == [f"checking {out_dir}/", "ok   placeholders", "ok   cluster/aws.yaml", "ok   cluster/gcp.yaml",
                   "ok   cluster/kuberay.yaml + cluster/kuberay-mlflow.yaml",
                   "ok   docker/Dockerfile + image references", "ok   .rayignore + .dockerignore", "all checks passed"]


def test_the_fill_in_is_idempotent_and_keeps_unset_placeholders(tmp_path, capsys):
    values = tmp_path / "values.env"
    values.write_text("".join(ln + "\n" for ln in VALUES.read_text().splitlines()
                              if not ln.startswith(("QED_GCP_PROJECT", "QED_FILESTORE_IP"))))
    out_dir = tmp_path / "filled"
    runs = []
    for _ in range(2):
        rc, out, _ = _run(fill.main, ["--values", str(values), "--out", str(out_dir)], capsys)
        files = {p.relative_to(out_dir): p.read_bytes() for p in sorted(out_dir.rglob("*")) if p.is_file()}
        runs.append((rc, out, files))
    assert runs[0] == runs[1]
    assert len(runs[0][2]) == 10  # 3 files of aws, 4 of gcp, 3 of kuberay
    assert runs[0][1][1:] == ["  aws: ready for python cluster/check.py aws",
                              "  gcp: still needs QED_GCP_PROJECT, QED_FILESTORE_IP",
                              "  kuberay: ready for python cluster/check.py kuberay"]
    assert b"project_id: your-gcp-project" in runs[0][2][Path("gcp.yaml")]


@pytest.mark.parametrize("line, error", [
    ("QED_REGISTRY=ghcr.io/your-org",
     "error: values.env:2: QED_REGISTRY=ghcr.io/your-org is itself a placeholder: put the registry you pushed the "
     "image to with docker/build.sh (REGISTRY=...), without /qed-ray (e.g. ghcr.io/acme-lab)"),
    ("QED_AWS_ACCOUNT=123456789012",
     "error: values.env:2: QED_AWS_ACCOUNT=123456789012 is itself a placeholder: put your AWS account id (12 digits) "
     "(e.g. 210987654321)"),
    ("QED_EFS_ID=fs-REPLACE-ME",
     "error: values.env:2: QED_EFS_ID=fs-REPLACE-ME is itself a placeholder: put the EFS file system id (AWS one-time "
     "setup) (e.g. fs-0abcdef1234567890)"),
    ("QED_BUCKET=",
     "error: values.env:2: QED_BUCKET= is empty: put the S3 (AWS, EKS) or GCS (GCP, GKE) bucket for MLflow artifacts "
     "(e.g. acme-qed-artifacts)"),
    ("QED_REGISTRY=ghcr.io/acme-lab/qed-ray",
     "error: values.env:2: QED_REGISTRY=ghcr.io/acme-lab/qed-ray is malformed: put the registry you pushed the image "
     "to with docker/build.sh (REGISTRY=...), without /qed-ray (e.g. ghcr.io/acme-lab)"),
    ("QED_AWS_ACCOUNT=2109-8765-4321",
     "error: values.env:2: QED_AWS_ACCOUNT=2109-8765-4321 is malformed: put your AWS account id (12 digits) "
     "(e.g. 210987654321)"),
    ("QED_FILESTORE_IP=10.130.32",
     "error: values.env:2: QED_FILESTORE_IP=10.130.32 is not an IPv4 address: put the Filestore instance's IP "
     "address (GCP one-time setup) (e.g. 10.130.32.2)"),
    ("QED_REGISTERY=ghcr.io/acme",
     "error: values.env:2: QED_REGISTERY is not one of the variables (did you mean QED_REGISTRY? allowed: "
     + ", ".join(p.variable for p in PLACEHOLDERS) + ")"),
    ("QED_AMI=ami-0abcdef1234567890", "error: values.env:2: QED_AMI is set twice"),
    ("QED_AMI ami-0abcdef1234567890",
     "error: values.env:2: 'QED_AMI ami-0abcdef1234567890' is not a VARIABLE=value line"),
])
def test_a_refused_value_names_its_line_and_writes_nothing(tmp_path, capsys, line, error):
    (tmp_path / "values.env").write_text(f"QED_AMI=ami-0abcdef1234567890\n{line}\n")
    out_dir = tmp_path / "cluster" / "filled"
    rc, out, err = _run(fill.main, ["--root", str(tmp_path), "--values", str(tmp_path / "values.env"),
                                    "--out", str(out_dir)], capsys)
    assert (rc, out) == (2, [])
    assert err == [error, "nothing written to cluster/filled/"]
    assert not out_dir.exists()


def test_the_shipped_example_lists_every_variable_commented_out():
    example = ROOT / "cluster" / "values.env.example"
    assert example.read_text() == example_text(ROOT / "cluster")
    assert read_values(example, "example") == {}  # every variable commented out: nothing filled by accident
    assert [ln for ln in example.read_text().splitlines() if ln.startswith("# QED_")] == [
        f"# {p.variable}=" for p in PLACEHOLDERS]


def test_a_missing_env_file_says_where_to_start(tmp_path, capsys):
    shutil.copytree(ROOT / "cluster", tmp_path / "cluster", ignore=shutil.ignore_patterns("filled", "values.env"))
    rc, out, err = _run(fill.main, ["--root", str(tmp_path)], capsys)
    assert (rc, out) == (2, [])
    assert err == ["error: cluster/values.env: no such file (start from cluster/values.env.example: "
                   "cp cluster/values.env.example cluster/values.env)"]


def test_by_default_the_filled_in_copies_are_checked_and_must_be_up_to_date(tmp_path, capsys):
    for name in ("pyproject.toml", "Makefile", ".rayignore", ".dockerignore"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("cluster", "docker"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "filled", "values.env"))
    shutil.copy(VALUES, tmp_path / "cluster" / "values.env")
    assert _run(fill.main, ["--root", str(tmp_path)], capsys)[:2] == (0, [
        "wrote cluster/filled/ from cluster/values.env (9 variable(s) set)", "  aws: ready for python cluster/check.py aws",
        "  gcp: ready for python cluster/check.py gcp", "  kuberay: ready for python cluster/check.py kuberay"])
    aws = tmp_path / "cluster" / "aws.yaml"
    aws.write_text(aws.read_text().replace("max_workers: 8", "max_workers: 6"))  # a template changed since
    rc, out, _ = _run(check.main, ["aws", "--root", str(tmp_path)], capsys)
    assert rc == 1
    assert out[:5] == ["checking cluster/filled/", "ok   placeholders", "FAIL cluster/filled/ up to date",
                       "     - cluster/filled/aws.yaml: out of date with cluster/aws.yaml and cluster/values.env: run "
                       "python cluster/fill.py", "ok   cluster/aws.yaml"]
    assert out[-1] == "1 problem(s)"
