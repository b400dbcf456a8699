"""``python -m qed_ray.gather SWEEP_DIR``: ``qed-ray gather``."""

import sys

from qed_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["gather", *sys.argv[1:]]))
