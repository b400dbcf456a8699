"""The service wing: the sweep driver, its trials, packing, the sweep folder's state and lock, status, the dry run,
the gather actor, re-analysis and MLflow tracking: the only wing that imports Ray or MLflow (at module level in its
modules, never here, so that importing a pure module such as :mod:`qed_ray.service.plan.machines` stays light)."""
