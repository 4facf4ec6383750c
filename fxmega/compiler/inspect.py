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
    # Where it sits among the graph's compute, in FLOPs (torch's formulas: matmuls, attention,
    # convolutions) done before it: traced, it is issued at ``issue_flops`` and waited for at
    # ``wait_flops``; reordered as far as its data allows, it could be issued at ``ready_flops``
    # (its inputs exist) and waited for at ``needed_flops`` (the first compute that reads it).
    issue_flops: float = 0.0
    wait_flops: float = 0.0
    ready_flops: float = 0.0
    needed_flops: float = 0.0
    issue_node: int = 0  # the positions of the collective and of its wait among the graph's nodes
    wait_node: int = 0

    @property
    def flops_between(self) -> float:
        """The FLOPs between its start and its wait in graph order: what it can hide behind."""
        return self.wait_flops - self.issue_flops

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
    before = [0.0]  # before[i]: the FLOPs of the compute ops ahead of node i
    for f in flops:
        before.append(before[-1] + (f or 0.0))
    ready, needed = _ready_and_needed(nodes, flops, before)
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
        wait_at = _wait_index(node, nodes, at)
        hidden = [f for f in flops[at + 1:wait_at] if f is not None]
        inputs_ready = max((ready[a] for a in node.all_input_nodes), default=0.0)
        first_use = needed[nodes[wait_at]] if wait_at < len(nodes) else before[-1]
        for val in vals:
            found.append(Collective(name, group, _get_group_size_by_name(group), tuple(val.shape),
                                    val.element_size(), share, len(hidden), before[at], before[wait_at],
                                    inputs_ready, max(first_use, inputs_ready), at, wait_at))
    return found


def _ready_and_needed(nodes: list[torch.fx.Node], flops: list[float | None],
                      before: list[float]) -> tuple[dict, dict]:
    """Per node: the compute FLOPs done by the time its value can exist, were everything that
    is not compute moved as early as its inputs allow (``ready``), and the FLOPs done before
    the first compute op that needs it, were everything that is not compute moved as late
    as its users allow (``needed``; the graph's end for what only reaches the outputs).
    Compute ops keep their order: they are the clock."""
    ready: dict[torch.fx.Node, float] = {}
    for i, n in enumerate(nodes):
        ready[n] = before[i + 1] if flops[i] is not None else max((ready[a] for a in n.all_input_nodes), default=0.0)
    needed: dict[torch.fx.Node, float] = {}
    for i in range(len(nodes) - 1, -1, -1):
        n = nodes[i]
        needed[n] = before[i] if flops[i] is not None else min((needed[u] for u in n.users), default=before[-1])
    return ready, needed


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
