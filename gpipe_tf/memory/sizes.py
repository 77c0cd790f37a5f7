"""Memory sizes as users write them (16GiB, 8GB, 512MiB, 1000000) and as reports print them."""

from __future__ import annotations

import re

from gpipe_tf.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}


def parse_bytes(text: str, flag: str = "--device_memory") -> int:
    """Bytes in `text`: a number with an optional unit (B, KiB, MiB, GiB, TiB: powers of 1024; KB, MB, GB, TB:
    powers of 1000), e.g. '16GiB', '8 GB', '1.5GiB', '1000000'. Raises ConfigError naming the bad value."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(f"{flag}={text!r} is not a memory size; use a positive number with a unit from B, KiB, "
                          "MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000), e.g. 16GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def human(num_bytes: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:,.1f} {unit}" if unit != "B" else f"{int(num_bytes):,} B"
        num_bytes /= 1024
    return f"{num_bytes:,.1f} TiB"
