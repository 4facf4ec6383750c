"""Peak memory of a step: the CUDA allocator's statistics on a GPU, the resident set's
high-water mark (Linux /proc) on the CPU."""

from __future__ import annotations

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size


def current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status("VmRSS")


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(f"{field} not in /proc/self/status")
