"""``python -m qed_ray.pack_run`` is gone: a pack of seeds is a run of ``python -m qed_ray.train --seeds ...``."""

from __future__ import annotations

import sys

NEW_FORM = "python -m qed_ray.train --seeds 0 1 2 [--env-workers W] ... --out DIR"


def main(argv: list[str] | None = None) -> int:
    """Prints the one line naming the new form; exit code 2."""
    print(f"error: python -m qed_ray.pack_run was folded into the run CLI: use {NEW_FORM}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
