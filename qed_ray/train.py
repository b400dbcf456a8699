"""The run CLI: ``python -m qed_ray.train ... --seed 0 | --seeds 0 1 2 --out DIR`` (:mod:`qed_ray.rl.run`)."""

import sys

from qed_ray.rl.run import main

if __name__ == "__main__":
    sys.exit(main())
