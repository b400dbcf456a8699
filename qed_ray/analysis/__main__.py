"""The critic-proxy table of a gathered sweep (paper App. D): ``python -m qed_ray.analysis SWEEP_DIR``
(:func:`qed_ray.analysis.group_eval.main`)."""

import sys

from qed_ray.analysis.group_eval import main

if __name__ == "__main__":
    sys.exit(main())
