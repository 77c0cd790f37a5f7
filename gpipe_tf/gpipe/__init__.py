"""GPipe: partition a layer sequence into stages, place them on devices, schedule micro-batches, rematerialize.

One idea per module (torchgpipe's layout): `plan` (the stage plan: split, costs, remat, devices, from Params),
`partition` (balancing), `placement` (devices), `microbatch` (split/merge), `remat` (recomputation policies),
`pipeline` (the GPipe layer and its schedule) and `timeline` (the predicted fill-drain timeline and its picture).
"""
