"""Inputs: generators of batches (`tf.data`) built from Params, synthetic and TFDS; docs/layout.md names them."""
