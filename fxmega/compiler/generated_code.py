"""Reading inductor's generated code: which collectives a graph issues, and what compute
kernels run between each collective's start and its wait (what it can hide behind).

The code is the text inductor writes for one graph (``output_code``), so this reads it with
regular expressions over the calls torch's functional collectives lower to."""

from __future__ import annotations

import re
from collections import Counter

_COLLECTIVE = re.compile(r"_c10d_functional\.(all_reduce_coalesced|all_reduce|reduce_scatter_tensor_coalesced|"
                         r"reduce_scatter_tensor|all_gather_into_tensor_coalesced|all_gather_into_tensor|"
                         r"all_to_all_single)\b")


# a collective call: its result buffer (``bufN = ...``), or for an in-place one
# (``all_reduce_``) its first argument, is what its wait names
_ISSUED = re.compile(r"(?:(buf\d+) = )?torch\.ops\._c10d_functional\.(\w+?)_?\.default"
                     r"\((?:reinterpret_tensor\()?(\w+)?")
_WAIT = re.compile(r"_c10d_functional\.wait_tensor\.default\((?:reinterpret_tensor\()?(\w+)")
_KERNEL = re.compile(r"^\s*(?:\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+)(?:\.run)?\(", re.M)


_BUFFER = re.compile(r"\bbuf\d+\b")


def _code_events(code: str, with_reads: bool = False) -> list[tuple[int, str, str]]:
    """(offset, kind, what) in one graph's generated code: ``issue`` (op:buffer), ``wait``
    (buffer) and ``kernel`` events (``with_reads``: the kernel's line, naming what it reads),
    in the order the code runs them."""
    def line_at(start: int) -> str:
        end = code.find("\n", start)
        return code[start:end if end >= 0 else len(code)] if with_reads else ""

    return sorted([(m.start(), "kernel", line_at(m.start())) for m in _KERNEL.finditer(code)]
                  + [(m.start(), "issue", f"{m.group(2)}:{m.group(1) or m.group(3)}") for m in _ISSUED.finditer(code)
                     if m.group(2) != "wait_tensor" and (m.group(1) or m.group(3))]
                  + [(m.start(), "wait", m.group(1)) for m in _WAIT.finditer(code)])


def kernels_before_waits(code: str) -> list[tuple[str, int]]:
    """For each collective in one graph's generated code, in issue order: its op and how
    many compute kernels (fused kernels, extern matmuls) run between its start and its
    wait, which is the compute it can hide behind (0: exposed)."""
    open_, out = {}, []
    for _, kind, what in _code_events(code):
        if kind == "issue":
            op, buf = what.split(":")
            open_[buf] = len(out)
            out.append([op, 0])
        elif kind == "wait":
            open_.pop(what, None)
        else:
            for i in open_.values():
                out[i][1] += 1
    return [(op, n) for op, n in out]


def gathers_ahead(code: str) -> int:
    """The most all-gathers one graph's generated code has issued whose result no kernel
    has read yet, at any point: how far ahead it fetches (ZeRO-3: each holds one piece's
    full parameters before the piece runs)."""
    ahead: set[str] = set()
    most = 0
    for _, kind, what in _code_events(code, with_reads=True):
        if kind == "issue" and what.split(":")[0].startswith("all_gather"):
            ahead.add(what.split(":")[1])
            most = max(most, len(ahead))
        elif kind == "kernel":
            ahead -= set(_BUFFER.findall(what))
    return most


def collectives_in(code: str | list[str]) -> Counter:
    """Count the collective calls in inductor's generated code (one or several graphs)."""
    text = "\n".join(code) if isinstance(code, list) else code
    return Counter(m.group(1) for m in _COLLECTIVE.finditer(text))
