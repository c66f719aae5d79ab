"""Training: state, losses, schedules, steps, checkpoints, metric writers, the loop.

Knows nothing about attention variants.
"""
