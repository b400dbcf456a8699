"""The analysis wing: cross-seed metrics, intervals, typed results, tables, comparisons, the verdict, figures and the
evaluation of a group's saved policies. It imports no Ray and no MLflow (the service logs what it computes); it
imports the RL and records wings and the floor."""
