"""Numerical checks of the paper's theory: ``python -m qed_ray.theory ...`` (:mod:`qed_ray.paper.theory`)."""

import time

from qed_ray.paper.theory import main

if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"wall time {time.perf_counter() - start:.1f} s")
