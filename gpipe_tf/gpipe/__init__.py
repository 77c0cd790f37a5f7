"""GPipe: partition a layer sequence into stages, place them on devices, schedule micro-batches, rematerialize.

One idea per module (torchgpipe's layout): `plan` (the stage plan: split, costs, remat, devices, from Params),
`batch_shapes` (the micro-batch shapes Params give),
`partition` (balancing), `placement` (devices), `microbatch` (split/merge), `leaves` (which leaves of a stage
boundary carry gradients), `remat` (recomputation policies), `pipeline` (the GPipe layer), `schedule_base` (the
schedule contract and the loss a task hands the pipeline), `schedules` (their names), `orders` (each schedule's
order as data), one module per schedule (`fill_drain`, `one_f_one_b`, `interleaved`, `zero_bubble`,
`zero_bubble_v`, `unrolled`), `windowed_loop` (the loop of 1F1B, interleaved and the zero-bubble schedules),
`spmd` (a uniform stack's stages as one program over a stage axis), `loop_parts` (what the loops share),
`batched_weights` (weight gradients batched over micro-batches),
`xla_cells` (each chunk's forward and backward compiled by XLA on its device) and `timeline` (predicted and
measured timelines). docs/pipeline.md explains how they work together.
"""
