"""What a compiled step communicates: every collective in its graphs, with its size and
process group, recorded by an inductor graph pass while the step compiles.

    with record_collectives() as graphs:
        run.do_step()          # compiles here
    for c in graphs[0]: print(c.op, c.group, c.bytes)

Recording disables inductor's graph cache for the graphs compiled inside the block (a
cached graph would skip the pass).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

_SKIP = {"wait_tensor"}


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce, all_gather_into_tensor, reduce_scatter_tensor, ...
    group: str  # process-group name
    group_size: int
    shape: tuple[int, ...]  # of the input tensor
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def bytes(self) -> int:
        """Bytes of the input tensor."""
        return self.numel * self.itemsize

    @property
    def bytes_sent_per_rank(self) -> float:
        """What each rank sends with a ring algorithm: all-reduce 2(W-1)/W of the buffer,
        all-gather (W-1) times its shard, reduce-scatter (W-1)/W of its input."""
        w = self.group_size
        if w <= 1:
            return 0.0
        if self.op.startswith("all_reduce"):
            return 2 * (w - 1) / w * self.bytes
        if self.op.startswith("all_gather"):
            return (w - 1) * self.bytes
        return (w - 1) / w * self.bytes


class _Recorder(CustomGraphPass):
    def __init__(self) -> None:
        self.graphs: list[list[Collective]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch.distributed.distributed_c10d import _get_group_size_by_name

        found = []
        for node in graph.nodes:
            target = node.target
            if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
                continue
            name = target._opname if hasattr(target, "_opname") else str(target).split(".")[1]
            if name in _SKIP:
                continue
            group = next((a for a in reversed(node.args) if isinstance(a, str)), "")
            inputs = node.args[0]
            vals = [i.meta["val"] for i in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
            for val in vals:
                found.append(Collective(name, group, _get_group_size_by_name(group), tuple(val.shape),
                                        val.element_size()))
        self.graphs.append(found)

    def uuid(self) -> Any:
        return None  # never cache: the pass must see every graph


@contextlib.contextmanager
def record_collectives() -> Iterator[list[list[Collective]]]:
    recorder = _Recorder()
    with torch._inductor.config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
        yield recorder.graphs


def count_by_op(collectives: list[Collective]) -> Counter:
    return Counter(c.op for c in collectives)
