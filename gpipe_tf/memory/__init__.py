"""Will it fit? Per-device memory of a pipeline from Params alone: `stage.py` (one stage), `plan.py` (every device
under a schedule, remat policy and optimizer), `suggest.py` (the smallest change that fits), `sizes.py` (sizes)."""
