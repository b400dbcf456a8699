"""The sweep service: ``python -m qed_ray.sweep SPEC`` (or ``ray job submit -- python -m qed_ray.sweep SPEC``;
the driver is :mod:`qed_ray.service.sweep`)."""

import sys

from qed_ray.service.sweep import main

if __name__ == "__main__":
    sys.exit(main())
