"""qed_ray: behavior-consistent RL (QED temperatures for SAC-LN and MAD-SAC) as a Ray Tune + MLflow service."""

__version__ = "0.1.0"
