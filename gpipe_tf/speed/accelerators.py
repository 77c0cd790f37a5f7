"""The devices a speed plan runs on: peak compute per dtype, memory, memory bandwidth, the link between neighbouring
pipeline devices, and the share of peak a training step achieves.

Presets are per pipeline device: a TPU core (a TPU v2 or v3 chip has two, and a pipeline stage runs on one) or a
whole GPU. Figures are the vendors' published peaks (docs/speed.md lists each with its source); what they assume
beyond the datasheet (the link between two neighbouring devices, the achieved share of peak) is named in
`Accelerator.assumes`. `accelerator(name)` picks a preset; `resolve` also takes the command line's figures for
anything else.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from gpipe_tf.errors import ConfigError

GIB = 2 ** 30

# The share of peak compute a well-shaped training step achieves on an accelerator (model FLOPs utilization);
# published large-model runs report 0.4-0.6 on TPUs and GPUs. One figure for every preset: a speed plan compares
# configurations on one device, where it cancels, except against memory-bound work and transfers.
DEFAULT_EFFICIENCY = 0.5
DEFAULT_LATENCY = 10e-6  # seconds per transfer between two devices (one send/receive pair)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One pipeline device.

    Attributes:
      name: the preset's name (or 'custom').
      peak_flops: peak FLOP/s by compute dtype name ('float32', 'bfloat16', 'float16'); a dtype missing here runs at
        the float32 rate.
      memory_bytes: device memory (the default --device_memory of a speed plan).
      memory_bandwidth: bytes/s between the device and its memory: the rate of memory-bound work (gradient
        accumulation, the optimizer's update).
      link_bandwidth: bytes/s, one direction, between two neighbouring pipeline devices.
      link_latency: seconds per transfer.
      efficiency: the share of peak_flops a step's compute achieves.
      source: where the peak figures come from.
      assumes: what the preset assumes beyond its source.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth: float
    link_bandwidth: float
    link_latency: float = DEFAULT_LATENCY
    efficiency: float = DEFAULT_EFFICIENCY
    source: str = ""
    assumes: str = ""

    def flops_per_second(self, dtype: str) -> float:
        """The FLOP/s a step achieves in compute dtype `dtype`: its peak times `efficiency`."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"]) * self.efficiency

    def transfer_seconds(self, num_bytes: float) -> float:
        """Seconds to send `num_bytes` to the neighbouring device (latency + bytes / bandwidth); 0 for no bytes."""
        return 0.0 if num_bytes <= 0 else self.link_latency + num_bytes / self.link_bandwidth

    def describe(self) -> str:
        """One line: name, peaks, memory, link and efficiency."""
        peaks = ", ".join(f"{dtype} {flops / 1e12:g} TFLOP/s" for dtype, flops in self.peak_flops.items())
        return (f"{self.name}: {peaks}; {self.memory_bytes / GIB:g} GiB at {self.memory_bandwidth / 1e9:g} GB/s; "
                f"link {self.link_bandwidth / 1e9:g} GB/s + {self.link_latency * 1e6:g} us; "
                f"{self.efficiency:.0%} of peak achieved")


_TPU_ASSUMES = ("one TensorCore per pipeline stage (half a chip's peak, memory and memory bandwidth); float32 "
                "matmuls at the bfloat16 rate (XLA's default precision on TPU multiplies in one bfloat16 pass); "
                "neighbouring cores one inter-chip link apart")
_GPU_ASSUMES = "neighbouring GPUs one NVLink link apart"
_NVSWITCH_ASSUMES = ("float32 matmuls at the TF32 rate (TensorFlow enables TF32 on Ampere and later by default); "
                     "every NVLink link of the device towards its pipeline neighbour (an NVSwitch system)")

PRESETS: dict[str, Accelerator] = {
    "tpu_v2": Accelerator(
        "tpu_v2", {"float32": 22.5e12, "bfloat16": 22.5e12}, 8 * GIB, 300e9, 62e9,
        source="Google Cloud TPU system architecture (v2 chip: 45 TFLOP/s bfloat16, 16 GiB HBM at 600 GB/s, two "
               "TensorCores); Jouppi et al. 2020, CACM 63(7) (inter-chip links 496 Gbit/s)",
        assumes=_TPU_ASSUMES),
    "tpu_v3": Accelerator(
        "tpu_v3", {"float32": 61.5e12, "bfloat16": 61.5e12}, 16 * GIB, 450e9, 82e9,
        source="Google Cloud TPU system architecture (v3 chip: 123 TFLOP/s bfloat16, 32 GiB HBM at 900 GB/s, two "
               "TensorCores); Jouppi et al. 2020, CACM 63(7) (inter-chip links 656 Gbit/s)",
        assumes=_TPU_ASSUMES),
    "p100": Accelerator(
        "p100", {"float32": 10.6e12, "float16": 21.2e12}, 16 * GIB, 732e9, 20e9,
        source="NVIDIA Tesla P100 SXM2 datasheet (10.6 TFLOP/s float32, 21.2 float16, 16 GB HBM2 at 732 GB/s, "
               "NVLink 1: 20 GB/s per link and direction)",
        assumes=_GPU_ASSUMES + "; bfloat16 at the float32 rate (no bfloat16 units)"),
    "v100": Accelerator(
        "v100", {"float32": 15.7e12, "float16": 125e12}, 32 * GIB, 900e9, 25e9,
        source="NVIDIA V100 SXM2 datasheet (15.7 TFLOP/s float32, 125 float16 tensor cores, 32 GB HBM2 at 900 GB/s, "
               "NVLink 2: 25 GB/s per link and direction)",
        assumes=_GPU_ASSUMES + "; bfloat16 at the float32 rate (no bfloat16 tensor cores)"),
    "a100": Accelerator(
        "a100", {"float32": 156e12, "bfloat16": 312e12, "float16": 312e12}, 80 * GIB, 2039e9, 300e9,
        source="NVIDIA A100 80GB SXM datasheet (156 TFLOP/s TF32, 312 bfloat16/float16 dense, 80 GB HBM2e at "
               "2,039 GB/s, NVLink 3: 600 GB/s both directions)",
        assumes=_NVSWITCH_ASSUMES),
    "h100": Accelerator(
        "h100", {"float32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12}, 80 * GIB, 3350e9, 450e9,
        source="NVIDIA H100 SXM5 datasheet (494.7 TFLOP/s TF32, 989.4 bfloat16/float16 dense, 80 GB HBM3 at "
               "3.35 TB/s, NVLink 4: 900 GB/s both directions)",
        assumes=_NVSWITCH_ASSUMES),
}


def _positive(flag: str, value: object, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag}={value!r} is invalid: give a positive number, e.g. {flag}={example}")
    return float(value)


def accelerator(name: str) -> Accelerator:
    """The preset named `name` (see PRESETS); a ConfigError naming the presets otherwise."""
    if name not in PRESETS:
        raise ConfigError(f"--accelerator={name!r} is not a preset; use one of {', '.join(PRESETS)}, or describe "
                          "the device with --accelerator_flops=FLOP/s --accelerator_bandwidth=bytes/s")
    return PRESETS[name]


RIDGE = 140.0  # peak FLOP/s per byte/s of memory bandwidth of the presets (TPU v3 core 137, V100 139, A100 153)


def resolve(name: str | None = None, flops: float | None = None, bandwidth: float | None = None) -> Accelerator:
    """The device a speed plan runs on: the preset `name`, with its peak FLOP/s (every dtype) replaced by `flops`
    and its link bandwidth by `bandwidth` where given; without a preset, both are needed and the rest is assumed
    (16 GiB, memory bandwidth = flops / RIDGE, DEFAULT_LATENCY, DEFAULT_EFFICIENCY)."""
    if name is None and (flops is None or bandwidth is None):
        raise ConfigError("a speed plan needs a device: --accelerator=NAME (one of " + ", ".join(PRESETS)
                          + "), or both --accelerator_flops=FLOP/s and --accelerator_bandwidth=bytes/s")
    if name is None:
        peak = _positive("--accelerator_flops", flops, "1.2e14")
        link = _positive("--accelerator_bandwidth", bandwidth, "5e10")
        return Accelerator("custom", {"float32": peak}, 16 * GIB, peak / RIDGE, link, source="the command line",
                           assumes=f"the same peak in every compute dtype; 16 GiB; memory bandwidth peak / {RIDGE:g}")
    device = accelerator(name)
    changed = []
    if flops is not None:
        peak = _positive("--accelerator_flops", flops, "1.2e14")
        device = dataclasses.replace(device, peak_flops={"float32": peak})
        changed.append(f"peak {peak:g} FLOP/s in every dtype")
    if bandwidth is not None:
        device = dataclasses.replace(device, link_bandwidth=_positive("--accelerator_bandwidth", bandwidth, "5e10"))
        changed.append(f"link {bandwidth:g} bytes/s")
    if changed:
        device = dataclasses.replace(device, name=f"{name} (custom)", assumes=device.assumes + "; from the command "
                                     "line: " + ", ".join(changed))
    return device
