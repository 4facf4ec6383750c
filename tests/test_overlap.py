"""parallel.overlap_comm: inductor's passes issue each gradient bucket's reduction while
the backward of earlier layers still computes, ZeRO-3's gather of the next piece while the
current one computes, and wait only where the result is used."""

from __future__ import annotations

import pytest
import torch

from fxmega.compiler.generated_code import gathers_ahead, kernels_before_waits
from fxmega.compiler.overlap import inductor_options
from fxmega.config import override
from fxmega.core.errors import ConfigError
from fxmega.models import model_for
from fxmega.training.checks import check_compute
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.overlap_workers import TWO_MICRO
from tests.parity import assert_matches_one_device, record
from tests.sharding_workers import tiny_config
from tests.tolerance import assert_losses_match

CODE = '''
        buf3 = empty_strided_cpu((4, ), (1, ), torch.float32)
        torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '0')
        extern_kernels.mm(buf1, buf2, out=buf4)
        cpp_fused_add_0(buf4, buf5)
        torch.ops._c10d_functional.wait_tensor.default(buf3)
        torch.ops._c10d_functional.all_reduce_.default(buf5, 'sum', '0')
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        cpp_fused_mul_1(buf5, buf6)
        buf7 = torch.ops._c10d_functional.all_gather_into_tensor.default(reinterpret_tensor(arg0_1, (8, )), 2, '0')
        buf8 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf6, 2, '0')
        cpp_fused_mul_2(buf5, buf9)
        torch.ops._c10d_functional.wait_tensor.default(buf7)
        cpp_fused_add_3(buf7, buf9)
        torch.ops._c10d_functional.wait_tensor.default(buf8)
        extern_kernels.mm(buf8, buf9, out=buf10)
'''


def test_kernels_before_waits_reads_generated_code():
    # an in-place collective is named by its argument, one with a result by the result
    # (whatever its argument: here a view of a graph input)
    assert kernels_before_waits(CODE) == [("all_reduce", 2), ("all_reduce", 0), ("all_gather_into_tensor", 1),
                                          ("all_gather_into_tensor", 2)]
    assert gathers_ahead(CODE) == 2  # both gathers issued before either is read


def test_refused_without_inductor():
    with pytest.raises(ConfigError, match="overlap_comm=true needs inductor"):
        override(tiny_config(), ["parallel.overlap_comm=true", "train.compile_backend=aot_eager"]).validate()


def test_async_tp_turns_on_inductors_micro_pipeline_pass():
    cfg = override(tiny_config(), ["parallel.async_tp=true", "parallel.sequence_parallel=true"]).validate()
    options = inductor_options(cfg.parallel)
    assert options == {"_micro_pipeline_tp": True}
    with torch._inductor.config.patch(options):  # a name inductor knows (patch refuses unknown ones)
        assert torch._inductor.config._micro_pipeline_tp
    both = inductor_options(override(cfg, ["parallel.overlap_comm=true"]).parallel)
    assert both["_micro_pipeline_tp"] and both["reorder_for_compute_comm_overlap"]


def test_async_tp_refused_where_it_cannot_run():
    base = tiny_config()
    with pytest.raises(ConfigError, match="async_tp=true is an inductor pass"):
        override(base, ["parallel.async_tp=true", "parallel.sequence_parallel=true",
                        "train.compile_backend=aot_eager"]).validate()
    with pytest.raises(ConfigError, match="without parallel.sequence_parallel=true"):
        override(base, ["parallel.async_tp=true"]).validate()
    cfg = override(base, ["parallel.async_tp=true", "parallel.sequence_parallel=true"]).validate()
    with pytest.raises(ConfigError, match="CUDA symmetric memory; this run is on cpu"):
        check_compute(cfg, None, torch.device("cpu"), model_for(cfg.model))
    with pytest.raises(ConfigError, match="this mesh has tp=1"):  # the device check passes on a CUDA device
        check_compute(cfg, None, torch.device("cuda"), model_for(cfg.model))


@pytest.mark.slow
@pytest.mark.e2e  # the schedule's shape; make test keeps the overlapped step's parity (the suite's time)
def test_every_gradient_reduction_has_compute_before_its_wait():
    got = run_ranks(2, "tests.overlap_workers:with_and_without", 3, dict(mesh="dp=2"))[0]
    off, on = ([op for graph in got[k]["hidden"] for op in graph] for k in (False, True))
    assert len(on) == len(off) and all(op == "all_reduce" for op, _ in on)  # the same collectives
    # at most one has nothing before its wait, one of the last two issued (measured: the 9th
    # of 10, near the update); all the earlier ones have compute to hide behind
    assert sum(n == 0 for _, n in on) <= 1 and all(n > 0 for _, n in on[:-2]), on
    # without the passes inductor leaves some exposed: what the setting is for
    assert any(n == 0 for _, n in off), off
    assert sum(n for _, n in on) > sum(n for _, n in off)
    # reordering moves no arithmetic: the same losses (fp32 sums over the batch)
    assert_losses_match(got[True]["losses"], got[False]["losses"], tiny_config(), "overlap on")


@pytest.mark.slow
@pytest.mark.e2e  # the schedule's shape; make test keeps the overlapped step's parity (the suite's time)
def test_zero3_gathers_the_next_piece_while_the_current_one_computes():
    # ZeRO-3 gathers each piece's parameters in the forward and again in the backward: with
    # the passes every gather is issued before compute it does not depend on (the piece
    # before it), so none waits with nothing done meanwhile. (Inductor's default order
    # already issues them early — their inputs, the parameters, exist at the step's start —
    # so this is not compared with the passes off.)
    got = run_ranks(2, "tests.overlap_workers:with_and_without", 2, dict(mesh="dp=2", rules="zero3"))[0]
    off, on = ([op for graph in got[k]["hidden"] for op in graph] for k in (False, True))
    gathers_on = [n for op, n in on if op.startswith("all_gather")]
    gathers_off = [n for op, n in off if op.startswith("all_gather")]
    assert len(gathers_on) == len(gathers_off) == 2 * 4 - 1  # 4 pieces; the head is not gathered twice
    assert all(n > 0 for n in gathers_on), on
    # one piece ahead (overlap.bound_gather_prefetch): a gather is issued once the previous
    # piece is being read, so at most one gathered piece waits for its first reader (raised
    # as far as its inputs allow, 5 of the 7 did at once)
    assert max(got[True]["ahead"]) == 1, got[True]["ahead"]
    assert_losses_match(got[True]["losses"], got[False]["losses"], tiny_config(), "zero3 overlap on")


def test_param_gather_refused_where_it_cannot_work():
    base = tiny_config()
    with pytest.raises(ConfigError, match="set parallel.overlap_comm=true"):
        override(base, ["parallel.overlap_param_gather=true"]).validate()
    cfg = override(base, ["parallel.overlap_param_gather=true", "parallel.overlap_comm=true"]).validate()
    with pytest.raises(ConfigError, match="ZeRO-0 on one device"):
        check_compute(cfg, None, torch.device("cpu"), model_for(cfg.model))


@pytest.mark.slow
def test_param_gather_at_the_next_step_start_matches_one_device():
    # Megatron's --overlap-param-gather: the updated shards are gathered at the start of the
    # next step, in the first micro batch's graph, the first layers' bucket first; with the
    # overlap passes each bucket's wait sits before the first layer that reads it, so every
    # bucket but the first two has forward compute to hide behind (the forward's first fused
    # kernel reads the embedding's bucket and the first block's norms, in the second)
    got = run_ranks(2, "tests.overlap_workers:param_gather", 3)[0]
    first, *rest = got["hidden"]  # the graphs in compile order: first micro batch, update
    gathers = [n for op, n in first if op.startswith("all_gather")]
    assert len(gathers) == got["buckets"] > 2, first
    assert sum(n > 0 for n in gathers) >= len(gathers) - 2, gathers
    # one bucket ahead of the one being read; two where one fused kernel reads two buckets
    assert got["ahead"][0] <= 2, got["ahead"]
    assert not any(op.startswith("all_gather") for graph in rest for op, _ in graph)  # not at the update's end
    cfg = tiny_config(compile=False, extra=TWO_MICRO)
    assert_matches_one_device(got, record(Run(cfg), 3), cfg, "overlap_param_gather")
