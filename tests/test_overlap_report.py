"""What a collective can hide behind: the compute a graph puts between its start and its
wait (``fxmega.compiler.inspect``), as ``run.py plan --rank`` reports it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxmega.cli import main
from fxmega.compiler.inspect import Collective, collectives_in
from fxmega.planning.devices import parse_profile
from fxmega.planning.exposure import link_seconds, replay
from fxmega.planning.fake import fake_world
from fxmega.sharding.mesh import MeshSpec
from tests.conftest import ROOT

aten, c10d = torch.ops.aten, torch.ops._c10d_functional
M, K, N = 8, 16, 4


def _graph(wait_after_matmul: bool) -> torch.fx.Graph:
    """``all_reduce(x)`` and ``a @ b``, with the wait after the matmul or before it."""
    g = torch.fx.Graph()
    x, a, b = g.placeholder("x"), g.placeholder("a"), g.placeholder("b")
    x.meta["val"], a.meta["val"], b.meta["val"] = torch.empty(32), torch.empty(M, K), torch.empty(K, N)
    started = g.call_function(c10d.all_reduce.default, (x, "sum", dist.group.WORLD.group_name))
    started.meta["val"] = torch.empty(32)

    def matmul() -> torch.fx.Node:
        node = g.call_function(aten.mm.default, (a, b))
        node.meta["val"] = torch.empty(M, N)
        return node

    def wait() -> torch.fx.Node:
        node = g.call_function(c10d.wait_tensor.default, (started,))
        node.meta["val"] = torch.empty(32)
        return node

    first, second = (matmul(), wait()) if wait_after_matmul else (wait(), matmul())
    g.output((first, second))
    return g


def test_compute_between_a_collective_and_its_wait_is_counted():
    with fake_world(2, 0):
        hidden = collectives_in(_graph(wait_after_matmul=True))
        exposed = collectives_in(_graph(wait_after_matmul=False))
    assert [(c.op, c.ops_between, c.flops_between) for c in hidden] == [("all_reduce", 1, 2.0 * M * K * N)]
    assert [(c.op, c.ops_between, c.flops_between) for c in exposed] == [("all_reduce", 0, 0.0)]
    # where it could go: its input is a placeholder (ready before any compute) and only the
    # graph's output reads it, so reordered it can hide behind the matmul either way
    mm = 2.0 * M * K * N
    assert [(c.issue_flops, c.wait_flops, c.ready_flops, c.needed_flops) for c in exposed] == [(0, 0, 0, mm)]
    assert [(c.issue_flops, c.wait_flops, c.ready_flops, c.needed_flops) for c in hidden] == [(0, mm, 0, mm)]


def _at(group: str, issue: float, wait: float, ready: float, needed: float, nodes: tuple[int, int]) -> Collective:
    return Collective("all_reduce", group, 2, (1000,), 4, None, 0, issue, wait, ready, needed, *nodes)


def test_replay_stalls_the_compute_for_what_is_not_hidden():
    one_second = lambda c: 1.0  # noqa: E731  every transfer takes a second; compute runs at 1 FLOP/s
    # traced: A issued and waited for before B is issued (graph order), nothing between: both exposed,
    # even on different links
    a, b = _at("x", 0, 0, 0, 3, (1, 2)), _at("y", 0, 0, 0, 3, (3, 4))
    assert [t.exposed_s for t in replay([a, b], one_second, 1.0, reordered=False)] == [1.0, 1.0]
    # reordered: both issued at once and waited for after 3 s of compute: hidden, on their own links
    assert [t.exposed_s for t in replay([a, b], one_second, 1.0, reordered=True)] == [0.0, 0.0]
    # on one link they run one after the other: the second ends at 2 s, still before its wait
    assert [t.exposed_s for t in replay([a, _at("x", 0, 0, 0, 1.5, (3, 4))], one_second, 1.0, True)] == [0.0, 0.5]
    # a stall delays the compute after it: B's wait at 2 FLOPs comes at 3 s, after A's 1 s stall
    late = [_at("x", 0, 0, 0, 0, (1, 2)), _at("y", 2, 3, 2, 3, (3, 4))]
    assert [t.exposed_s for t in replay(late, one_second, 1.0, reordered=False)] == [1.0, 0.0]
    assert [t.seconds for t in replay(late, one_second, 1.0, reordered=False)] == [1.0, 1.0]


def test_links_inside_a_node_are_nvlink_and_across_nodes_the_network():
    mesh = MeshSpec.parse("dp=2,tp=4")
    profile = parse_profile("h100,per_node=4")
    seconds = link_seconds(mesh, 5, {"g_tp": "tp", "g_dp": "dp", "g_world": "world"}, profile)
    tp, dp, world = (Collective("all_reduce", g, w, (1000,), 4) for g, w in (("g_tp", 4), ("g_dp", 2), ("g_world", 8)))
    assert seconds(tp) == tp.bytes_sent_per_rank / profile.intra_bw  # ranks 4-7: one node
    assert seconds(dp) == dp.bytes_sent_per_rank / profile.inter_bw  # ranks 1 and 5: two nodes
    assert seconds(world) == world.bytes_sent_per_rank / profile.inter_bw


def test_the_plan_reports_what_each_axis_can_hide_behind(capsys):
    assert main(["plan", "--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mesh", "dp=2,tp=2",
                 "--global-batch-size", "16", "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "nothing before wait" in out and "GFLOP before waits" in out
    assert "exposed ms traced" in out and "exposed communication per step" in out
