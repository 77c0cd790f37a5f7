"""Layers: `tf.Module`s built from Params with an explicit-weights forward pass; docs/layout.md names them."""
