"""What a compiled step communicates: every collective in its graphs, with its size and
process group, recorded while the step compiles — by an inductor graph pass, or, with
``train.compile_backend=aot_eager``, by fxmega's aot_eager compiler, which shows every graph
it is handed to the active recorders before running it op by op.

    with record_collectives() as graphs:
        run.do_step()          # compiles here
    for c in graphs[0]: print(c.op, c.group, c.bytes)

Recording disables inductor's graph cache for the graphs compiled inside the block (a
cached graph would skip the pass).

Each collective also says what compute the graph puts between its start and its wait
(``ops_between``, ``flops_between``: matmuls, attention and convolutions, counted by torch's
FLOP formulas): work it can hide behind, in the order the graph was traced. A collective
with nothing between is exposed unless a scheduler moves it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.flop_counter import flop_registry

_SKIP = {"wait_tensor"}


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce, all_gather_into_tensor, reduce_scatter_tensor, ...
    group: str  # process-group name
    group_size: int
    shape: tuple[int, ...]  # of the input tensor
    itemsize: int
    # all-to-all with split sizes: the share of the input that goes to other ranks (a ring
    # step sends all of it to one neighbour); None: an even split, (W-1)/W
    sent_share: float | None = None
    ops_between: int = 0  # compute ops between the collective and its wait, in graph order
    flops_between: float = 0.0  # their FLOPs (torch's formulas: matmuls, attention, convolutions)

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
        all-gather (W-1) times its shard, reduce-scatter (W-1)/W of its input; an all-to-all
        what its split sizes send to other ranks."""
        w = self.group_size
        if w <= 1:
            return 0.0
        if self.sent_share is not None:
            return self.sent_share * self.bytes
        if self.op.startswith("all_reduce"):
            return 2 * (w - 1) / w * self.bytes
        if self.op.startswith("all_gather"):
            return (w - 1) * self.bytes
        return (w - 1) / w * self.bytes


def collectives_in(graph: torch.fx.Graph) -> list[Collective]:
    """The collectives a (post-grad or AOTAutograd) graph issues, in graph order: one per
    input tensor of each ``_c10d_functional`` call (``wait_tensor`` left out)."""
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    nodes = list(graph.nodes)
    flops = [_flops(n) for n in nodes]
    found = []
    for at, node in enumerate(nodes):
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        name = target._opname if hasattr(target, "_opname") else str(target).split(".")[1]
        if name in _SKIP:
            continue
        group = next((a for a in reversed(node.args) if isinstance(a, str)), "")
        inputs = node.args[0]
        vals = [i.meta["val"] for i in (inputs if isinstance(inputs, (list, tuple)) else [inputs])]
        share = _sent_share(node.args[2], group) if name == "all_to_all_single" else None
        between = flops[at + 1:_wait_index(node, nodes, at)]
        hidden = [f for f in between if f is not None]
        for val in vals:
            found.append(Collective(name, group, _get_group_size_by_name(group), tuple(val.shape),
                                    val.element_size(), share, len(hidden), float(sum(hidden))))
    return found


def _wait_index(node: torch.fx.Node, nodes: list[torch.fx.Node], at: int) -> int:
    """Where the first wait on ``node``'s result is (directly, or through the getitem of a
    collective with several outputs); right after it if none is found (counted as exposed,
    not as hidden behind the rest of the graph)."""
    users = set(node.users)
    users |= {u for g in node.users if g.target is operator.getitem for u in g.users}
    for i in range(at + 1, len(nodes)):
        if nodes[i] in users and "wait_tensor" in str(nodes[i].target):
            return i
    return at + 1


def _flops(node: torch.fx.Node) -> float | None:
    """The FLOPs of a compute node that torch's counter has a formula for (None otherwise)."""
    packet = getattr(node.target, "overloadpacket", None)
    if node.op != "call_function" or packet not in flop_registry:
        return None
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return float(flop_registry[packet](*args, **kwargs, out_val=node.meta.get("val")))
    except (TypeError, AttributeError, IndexError):  # an argument without a traced value
        return None


def _sent_share(input_splits: Any, group: str) -> float | None:
    """The share of an all-to-all's input this rank sends to the others, from its split
    sizes (None when they are not given: an even split)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not input_splits or not all(isinstance(s, int) for s in input_splits):
        return None
    total = sum(input_splits)
    return (total - input_splits[_resolve_process_group(group).rank()]) / total if total else 0.0


class _Recorder(CustomGraphPass):
    def __init__(self) -> None:
        self.graphs: list[list[Collective]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.graphs.append(collectives_in(graph))

    def uuid(self) -> Any:
        return None  # never cache: the pass must see every graph


# Called with each graph fxmega's aot_eager backend compiles (see ``aot_eager_backend``).
_GRAPH_HOOKS: list[Callable[[torch.fx.Graph], None]] = []


@contextlib.contextmanager
def record_collectives() -> Iterator[list[list[Collective]]]:
    recorder = _Recorder()
    _GRAPH_HOOKS.append(recorder)
    try:
        with torch._inductor.config.patch(post_grad_custom_post_pass=recorder, fx_graph_cache=False):
            yield recorder.graphs
    finally:
        _GRAPH_HOOKS.remove(recorder)


def _inspected_nop(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
    from torch._dynamo.backends.debugging import boxed_nop

    for hook in list(_GRAPH_HOOKS):
        hook(gm.graph)
    return boxed_nop(gm, example_inputs)


def aot_eager_backend() -> Callable[..., Any]:
    """torch's ``aot_eager`` backend (AOTAutograd's graph, run op by op), with the graphs
    shown to ``record_collectives`` the way inductor's post-grad pass shows them — the
    backward graphs too, when a compiled function is differentiated outside it (pipeline
    stages)."""
    from torch._dynamo.backends.debugging import aot_eager

    return functools.partial(aot_eager, fw_compiler=_inspected_nop, bw_compiler=_inspected_nop)


def count_by_op(collectives: list[Collective]) -> Counter:
    return Counter(c.op for c in collectives)
