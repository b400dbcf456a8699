"""Relinks a moved or copied local sweep folder's MLflow artifacts: ``python -m qed_ray.relink SWEEP_DIR``
(:mod:`qed_ray.service.relink`)."""

import sys

from qed_ray.service.relink import main

if __name__ == "__main__":
    sys.exit(main())
