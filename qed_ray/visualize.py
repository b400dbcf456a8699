"""Behaviour figures of a sweep (paper Fig. 1): ``python -m qed_ray.visualize SWEEP_DIR ...``
(:mod:`qed_ray.service.behaviour_cli`)."""

import sys

from qed_ray.service.behaviour_cli import main

if __name__ == "__main__":
    sys.exit(main())
