"""What a collective can hide behind: the compute a graph puts between its start and its
wait (``fxmega.sharding.inspect``), as ``run.py plan --rank`` reports it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxmega.cli import main
from fxmega.planning.fake import fake_world
from fxmega.sharding.inspect import collectives_in
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


def test_the_plan_reports_what_each_axis_can_hide_behind(capsys):
    assert main(["plan", "--config", str(ROOT / "configs" / "tiny_gpt.py"), "--mesh", "dp=2,tp=2",
                 "--global-batch-size", "16", "--rank", "0"]) == 0
    out = capsys.readouterr().out
    assert "nothing before wait" in out and "GFLOP before waits" in out
