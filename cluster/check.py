"""Pre-flight check of the cluster configs before `ray up` / `kubectl apply`: python cluster/check.py [--root DIR]

Checks, offline (no cloud credentials, no Docker, no Kubernetes): cluster/aws.yaml and cluster/gcp.yaml through Ray's
own launcher validators, cluster/kuberay.yaml through Ray's KubeRay-to-autoscaler conversion, and all of them, the
IAM files in cluster/iam/, the Filestore exports, the Dockerfile with its constraints and the ignore files against
the project's layout and trust boundaries (cluster/README.md). Prints each problem; exit status 1 if there is any.
The placeholders (ghcr.io/your-org, fs-REPLACE-ME, ...) are not checked: replace them first.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the preflight package beside this file

from preflight import run_all  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Runs every check and prints one line per problem; returns 0 if there is none, else 1."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="repository checkout to check (default: this one)")
    args = parser.parse_args(argv)
    import ray  # noqa: F401 - configures Ray's loggers, which the next line then quiets

    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray's validators log the defaults they fill in at INFO
    results = run_all(args.root)
    for section, problems in results.items():
        print(f"{'ok  ' if not problems else 'FAIL'} {section}")
        for problem in problems:
            print(f"     - {problem}")
    count = sum(len(p) for p in results.values())
    print(f"{count} problem(s)" if count else "all checks passed")
    return 1 if count else 0


if __name__ == "__main__":
    sys.exit(main())
