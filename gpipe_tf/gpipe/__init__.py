"""GPipe: partition a layer sequence into stages, place them on devices, schedule micro-batches, rematerialize.

One idea per module (torchgpipe's layout): `plan` (the stage plan: split, costs, remat, devices, from Params),
`partition` (balancing), `placement` (devices), `microbatch` (split/merge), `remat` (recomputation policies),
`pipeline` (the GPipe layer), `schedule_base` (the schedule contract and the loss a task hands the pipeline),
`schedules` (their names), one module per schedule (`fill_drain`, `one_f_one_b`, `interleaved`, `unrolled`) and
`timeline` (predicted and measured timelines and their pictures).
"""
