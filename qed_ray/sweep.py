"""The sweep service: ``python -m qed_ray.sweep SPEC``, here or as a Ray job (``--help`` gives the local
``ray job submit`` recipe; the command line is :mod:`qed_ray.service.sweep_cli`, the driver :mod:`qed_ray.service.sweep`)."""

import sys

from qed_ray.service.sweep_cli import main

if __name__ == "__main__":
    sys.exit(main())
