"""Device set-up that must happen before TensorFlow initializes its runtime."""

from __future__ import annotations

import tensorflow as tf

from gpipe_tf.errors import ConfigError


def split_cpu(num_devices: int) -> list[str]:
    """Splits the host CPU into `num_devices` logical devices (/CPU:0 .. /CPU:n-1); returns their names.

    Logical CPUs are placement labels that share one thread pool: right for correctness tests of a
    pipeline, not for timing it (docs/benchmarks.md says why, and measures on TF workers instead).
    """
    if num_devices < 1:
        raise ConfigError(f"--logical_devices={num_devices} must be >= 1")
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)])
    except RuntimeError as e:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing == num_devices:
            return [d.name for d in tf.config.list_logical_devices("CPU")]
        raise ConfigError(f"cannot split the CPU into {num_devices} logical devices: TensorFlow is already "
                          f"initialized with {existing} ({e}); set it before any TensorFlow op runs") from None
    # Named without asking TensorFlow: listing devices would start its runtime, and a multi-worker strategy
    # created next must still be able to configure it.
    return [f"/device:CPU:{i}" for i in range(num_devices)]
