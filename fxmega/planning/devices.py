"""The devices the planner prices a layout for: peak FLOP/s, memory, and the bandwidth of the
links inside a node and across nodes (``--device-profile h100`` or field by field)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fxmega.core.errors import ConfigError


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    memory: int  # bytes per device
    intra_bw: float  # bytes/s per direction between devices of a node (NVLink)
    inter_bw: float  # bytes/s per direction per device across nodes (InfiniBand)
    per_node: int = 8
    efficiency: float = 0.6  # fraction of peak the matmuls reach


# NVIDIA data sheets: dense bf16; NVLink 4 (H100/H200) 450 GB/s and NVLink 3 (A100) 300 GB/s
# per direction; one 400 Gb/s (H100/H200) or 200 Gb/s (A100) InfiniBand port per GPU.
PROFILES = {
    "h100": DeviceProfile("h100", 989e12, 80 * 10**9, 450e9, 50e9),
    "h200": DeviceProfile("h200", 989e12, 141 * 10**9, 450e9, 50e9),
    "a100": DeviceProfile("a100", 312e12, 80 * 10**9, 300e9, 25e9),
}


def parse_profile(text: str) -> DeviceProfile:
    """``h100`` or ``h100,inter=25e9`` or ``peak=500e12,memory=48e9,intra=100e9,inter=12.5e9,per_node=4``."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    base = PROFILES["h100"]
    if parts and "=" not in parts[0]:
        if parts[0].lower() not in PROFILES:
            raise ConfigError(f"--device-profile {text!r}: unknown device {parts[0]!r}; known: {', '.join(PROFILES)}, "
                              f"or give peak=,memory=,intra=,inter=,per_node=")
        base = PROFILES[parts.pop(0).lower()]
    keys = {"peak": "peak_flops", "memory": "memory", "intra": "intra_bw", "inter": "inter_bw",
            "per_node": "per_node", "efficiency": "efficiency"}
    changes: dict[str, Any] = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in keys:
            raise ConfigError(f"--device-profile {text!r}: unknown field {key!r}; fields: {', '.join(keys)}")
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"--device-profile {text!r}: {key}={value!r} is not a number") from None
        if number <= 0:
            raise ConfigError(f"--device-profile {text!r}: {key} must be more than zero")
        changes[keys[key]] = int(number) if key in ("memory", "per_node") else number
    return dataclasses.replace(base, name="custom" if changes else base.name, **changes)
