"""Actors: a vLLM engine each, many concurrent token-in/token-out episodes, trajectories out."""
