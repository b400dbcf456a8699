"""``python -m qed_ray.sweep SPEC``: ``qed-ray sweep`` (kept for ``ray job submit`` and the used-by command)."""

import sys

from qed_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
