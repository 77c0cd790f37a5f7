"""How fast will it run? A training step's time on an accelerator, predicted from Params alone:
`accelerators.py` (the device presets and custom devices), `costs.py` (each chunk's flops and transfers),
`step.py` (one configuration's step: the schedule's simulated order plus the optimizer's update) and `search.py`
(every K, M, schedule and remat worth trying, with the memory plan's verdict); docs/speed.md."""
