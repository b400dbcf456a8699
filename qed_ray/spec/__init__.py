"""The spec wing, the floor every other wing stands on: what the user writes (the sweep spec, its config blocks, the
grid, the k search, the claim), the names and labels derived from it, and the messages that explain it."""
