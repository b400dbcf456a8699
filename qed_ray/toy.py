"""The toy MDP experiment of the paper's Sec. 5.2: ``python -m qed_ray.toy ...`` (:mod:`qed_ray.paper.toy`)."""

from qed_ray.paper.toy import main

if __name__ == "__main__":
    main()
