"""Re-analysis of a sweep folder: ``python -m qed_ray.gather SWEEP_DIR`` (:mod:`qed_ray.service.reanalysis`)."""

import sys

from qed_ray.service.reanalysis import main

if __name__ == "__main__":
    sys.exit(main())
