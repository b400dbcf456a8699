"""The service's MLflow room: the only modules that import MLflow (tracking, the mirror, relinking, tags, the
tracking URI, the results view)."""
