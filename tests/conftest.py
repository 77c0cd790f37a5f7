"""Test session set-up: 4 logical CPU devices, configured before any test initializes TensorFlow."""

from gpipe_tf import devices

NUM_LOGICAL_DEVICES = 4
devices.split_cpu(NUM_LOGICAL_DEVICES)
