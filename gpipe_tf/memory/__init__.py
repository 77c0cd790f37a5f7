"""Will it fit? Per-device memory of a pipeline from Params alone: `stage.py` (one stage), `stash.py` (the
micro-batches each schedule stashes per stage), `plan.py` (every device under a schedule, remat policy and
optimizer), `head.py` (the task's loss head, on the last chunk's device), `suggest.py` (the smallest change that
fits), `out_of_memory.py` (the one line for a device that ran out) and `sizes.py` (sizes as users write them);
docs/memory.md."""
