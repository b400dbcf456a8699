"""The RL wing: agents, networks, temperatures, envs, replay, the training loop, its update, checkpoints and
evaluation rollouts. It imports neither Ray nor MLflow (and dm_control only where envs are built), so the training
core runs with torch, numpy and pydantic alone; it imports only the floor, the records wing and itself."""
