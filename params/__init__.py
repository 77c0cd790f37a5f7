"""Experiment definitions, one area per folder; each class registers as `<area>.<module>.<Class>`."""
