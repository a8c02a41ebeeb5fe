"""The learner: GRPO advantages, the clipped policy loss, FSDP2 training and the weight broadcast.

Entry point: :func:`horizonrl.learner.main.main`, run once per rank (torchrun-style env vars).
Nothing heavy is imported here, so ``import horizonrl.learner`` stays cheap.
"""
