"""Training: the train step, the loop, evaluation, checkpoints, summaries and exports; docs/layout.md names
its modules."""
