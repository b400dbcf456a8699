"""The task registry's smoke check: ``python -m qed_ray.envs --check-all`` (:mod:`qed_ray.rl.envs`)."""

import sys

from qed_ray.rl.envs import main

if __name__ == "__main__":
    sys.exit(main())
