"""Exposed communication: how long a step waits for its collectives, from the traced graphs.

Each graph is replayed on a two-resource timeline. Compute runs its ops in graph order at
``flop_rate`` (the profile's peak x efficiency: matmuls, attention, convolutions; other ops
are taken as free); each process group's collectives run one after another on their own
link (NCCL gives every communicator its own stream) at that link's bandwidth, a collective
starting once it is issued and its link is free. A wait stalls the compute until its
collective is done; the stalls summed are the exposed communication. Two orders are
replayed: the traced one (a collective issued and waited for where tracing met it), and the
one inductor's overlap passes aim at (``parallel.overlap_comm``: each collective issued as
soon as its inputs exist, waited for just before the first compute that reads it).

This is a planning model, like ``fxmega.planning.auto``'s step time: latency, link sharing
between groups and the compute a collective's kernels take from the SMs are left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxmega.compiler.inspect import Collective
from fxmega.planning.devices import DeviceProfile
from fxmega.sharding.mesh import MeshSpec


@dataclass(frozen=True)
class Timed:
    collective: Collective
    seconds: float  # its transfer time on its link
    exposed_s: float  # how long the compute stalled in its wait


def replay(graph: list[Collective], seconds: Callable[[Collective], float], flop_rate: float,
           reordered: bool) -> list[Timed]:
    """One graph's collectives (in graph order) with their transfer times ``seconds(c)`` and
    the stall each one's wait causes, the compute running at ``flop_rate`` FLOP/s; at the
    positions inductor's passes aim at when ``reordered``, else where they were traced."""
    # (FLOPs done, then: reordered, issues before waits; traced, the graph's order; 0 issue | 1 wait, index)
    events = []
    for i, c in enumerate(graph):
        if reordered:
            events += [(c.ready_flops, 0, 0, i), (c.needed_flops, 1, 1, i)]
        else:
            events += [(c.issue_flops, c.issue_node, 0, i), (c.wait_flops, c.wait_node, 1, i)]
    stall = 0.0
    link_free: dict[str, float] = {}
    done: dict[int, float] = {}
    took = [seconds(c) for c in graph]
    stalls = [0.0] * len(graph)
    for flops, _, kind, i in sorted(events):
        now = flops / flop_rate + stall
        if kind == 0:
            group = graph[i].group
            done[i] = max(now, link_free.get(group, 0.0)) + took[i]
            link_free[group] = done[i]
        elif done[i] > now:
            stalls[i] = done[i] - now
            stall += stalls[i]
    return [Timed(c, t, s) for c, t, s in zip(graph, took, stalls)]


def link_seconds(mesh: MeshSpec, rank: int, labels: dict[str, str],
                 profile: DeviceProfile) -> Callable[[Collective], float]:
    """A collective's transfer time: what a rank sends in a ring (``bytes_sent_per_rank``)
    over NVLink when its group's ranks share this rank's node (ranks ``per_node`` to a node,
    numbered as ``MeshSpec`` lays them out), else over the network."""
    node_of = rank // profile.per_node
    inside: dict[str, bool] = {}

    def within_node(group: str) -> bool:
        if group not in inside:
            axes = labels.get(group, group).split("+")
            if all(a in mesh.names for a in axes):
                mine = mesh.coords(rank)
                same = [r for r in range(mesh.world_size)
                        if all(c == mine[a] for a, c in mesh.coords(r).items() if a not in axes)]
                inside[group] = all(r // profile.per_node == node_of for r in same)
            else:  # the world, or a pipeline group (first and last stage): within a node only if all are
                inside[group] = mesh.world_size <= profile.per_node
        return inside[group]

    return lambda c: c.bytes_sent_per_rank / (profile.intra_bw if within_node(c.group) else profile.inter_bw)
