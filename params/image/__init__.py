"""Image classification experiments (AmoebaNet)."""
