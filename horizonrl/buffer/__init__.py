"""The buffer: trajectories in, whole GRPO groups out, staleness-bounded, with backpressure."""
