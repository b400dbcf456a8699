"""Test oracles: the single-seed update a pack is checked against, and the update maths of checkpoint format 1."""
