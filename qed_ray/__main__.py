"""``python -m qed_ray COMMAND ...``: :mod:`qed_ray.cli`."""

import sys

from qed_ray.cli import main

if __name__ == "__main__":
    sys.exit(main())
