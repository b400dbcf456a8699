"""The test kit, defined once: tiny agent settings and batches (:mod:`kit.agents`), the one sweep-spec builder
(:mod:`kit.sweeps`), processes of the end-to-end tests (:mod:`kit.processes`) and printed text read as values
(:mod:`kit.text`). Sweep folders by hand are in ``folder_helpers.py``, the real CLI and MLflow store in
``sweep_helpers.py``, Ray clusters in ``ray_cluster.py``, fixtures in ``conftest.py``."""

from kit.agents import ACT, B, OBS, QED, TEMPERATURES, TINY_MAD, batch_of, spec_of, tiny_mad
from kit.processes import HEAVY, cli_run, cmdline, descendants, free_port, lone_trial_process, stat_fields
from kit.sweeps import SWEEP, TRAIN, sweep_file, sweep_raw, sweep_spec
from kit.text import GROUP_COLUMNS, counts, flat, outcomes, widest

__all__ = ["ACT", "B", "GROUP_COLUMNS", "HEAVY", "OBS", "QED", "SWEEP", "TEMPERATURES", "TINY_MAD", "TRAIN",
           "batch_of", "cli_run", "cmdline", "counts", "descendants", "flat", "free_port", "lone_trial_process",
           "outcomes", "spec_of", "stat_fields", "sweep_file", "sweep_raw", "sweep_spec", "tiny_mad", "widest"]
