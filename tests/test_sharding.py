"""Sharded training on local gloo ranks equals single-device training; the compiled graphs
hold the collectives each strategy needs and no others; ZeRO-3 saves memory during the step.

Compiling on 2 CPU cores is slow (~40 s per strategy), so one group of 2 ranks runs every
2-rank strategy once (module-scoped fixture) and the tests below read its results."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fxmega.core import tree
from fxmega.parallel.collectives import buckets
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device, record, unpad
from tests.sharding_workers import BUCKET, MEMORY_ENV, STRATEGIES, tiny_config
from tests.tolerance import assert_within_rounding

STEPS = 5


@pytest.fixture(scope="module")
def reference():
    return record(Run(tiny_config(compile=False)), STEPS)


@pytest.fixture(scope="module")
def results():
    return run_ranks(2, "tests.sharding_workers:strategies", list(STRATEGIES), STEPS)[0]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_matches_single_device(results, reference, name):
    r = results[name]
    assert_matches_one_device(r, reference, tiny_config(), name)
    padded = r["params"]["embed.tokens"]
    if name.startswith("tp"):
        assert padded.shape[0] == 256 and torch.all(padded[255] == 0)  # padding row never learns
    # tp alone has one data rank, so the global batch of 8 is two micro batches of 4:
    # an accumulate graph and an update graph, each compiled once
    expected = 2 if name.startswith("tp") else 1
    assert r["graphs"] == expected, f"{name} compiled {r['graphs']} graphs in {STEPS} steps"


def _ops(r, axes: str, scalars: bool = False) -> Counter:
    """Collectives on one group; the two per-step scalars (the loss over the data axis, the
    gradient norm over all ranks) are left out unless asked for."""
    return Counter(op for op, group, shape, _ in r["collectives"][-1]
                   if group == axes and (scalars or shape != ()))


def _scalars(r) -> int:
    return sum(1 for op, _, shape, _ in r["collectives"][-1] if op == "all_reduce" and shape == ())


def _n_buckets(r, which) -> int:
    numels = [n for n, keep in zip(r["local_numels"], which) if keep]
    return len(buckets(numels, BUCKET))


@pytest.mark.slow
def test_data_parallel_reduces_gradients_per_bucket_not_per_parameter(results):
    r = results["dp2"]
    n_buckets = _n_buckets(r, [True] * r["n_params"])
    assert 1 < n_buckets < r["n_params"] // 2
    assert _ops(r, "dp") == Counter({"all_reduce": n_buckets})  # one per bucket, not per parameter
    assert _scalars(r) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero12_reduce_scatter_gradients_and_all_gather_parameters(results, name):
    r = results[name]
    sharded = [d is not None for d in r["zero_dims"]]
    replicated = [not s for s in sharded]
    assert _ops(r, "dp") == Counter({"reduce_scatter_tensor": _n_buckets(r, sharded),
                                     "all_gather_into_tensor": _n_buckets(r, sharded),
                                     "all_reduce": _n_buckets(r, replicated)})
    assert _scalars(r) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name,axis", [("zero3", "dp"), ("fsdp2", "fsdp")])
def test_zero3_gathers_each_piece_forward_and_backward(results, name, axis):
    r = results[name]
    pieces = 2 + 2  # embedding, two blocks, head
    ops = _ops(r, axis)
    # forward, and again in the backward (except the head, whose backward comes right after)
    assert ops["all_gather_into_tensor"] == 2 * pieces - 1
    assert ops["reduce_scatter_tensor"] == pieces  # the gathers' backward
    assert _scalars(r) == 2


@pytest.mark.slow
def test_plain_tensor_parallel_never_gathers(results):
    ops = _ops(results["tp2"], "tp")
    assert ops["all_reduce"] > 0 and ops["all_gather_into_tensor"] == 0 and ops["reduce_scatter_tensor"] == 0


@pytest.mark.slow
def test_sequence_parallel_gathers_only_activations(results):
    r = results["tp2_sp"]
    ops = _ops(r, "tp")
    assert ops["all_gather_into_tensor"] > 0 and ops["reduce_scatter_tensor"] > 0
    gathered = {shape for op, group, shape, _ in r["collectives"][-1]
                if group == "tp" and op == "all_gather_into_tensor"}
    # activations [micro batch, seq/tp, embed], and the position table's gradient
    # [seq/tp, embed] (it meets the residual stream split along seq); never a weight
    assert gathered == {(4, 16, 64), (16, 64)}, gathered


@pytest.mark.slow
def test_dp2_tp2_four_ranks_match_single_device():
    # tiny Llama here (GQA, RoPE), with sequence parallelism and ZeRO-1
    cfg = tiny_config(compile=False, model="tiny_llama")
    ref = record(Run(cfg), STEPS)
    r = run_ranks(4, "tests.sharding_workers:four_ranks", STEPS)[0]
    assert_matches_one_device(r, ref, cfg, "dp2 x tp2")
    assert r["graphs"] == 1
    groups = Counter(group for op, group, _, _ in r["collectives"][0])
    assert groups["tp"] > 0 and groups["dp"] > 0


@pytest.mark.slow
def test_sharded_init_is_the_slice_of_the_full_init():
    from fxmega.models import gpt
    from fxmega.ops.init import init_params

    cfg = tiny_config(compile=False)
    full = {p: t for p, t in tree.items(init_params(gpt.param_specs(cfg.model), cfg.train.seed))}
    per_rank = run_ranks(2, "tests.sharding_workers:sharded_init")
    for rank, cases in enumerate(per_rank):
        for case in cases:
            for path, local in case["local"].items():
                tp_dim, zero_dim, data_axes = case["layouts"][path]
                expect = full[path]
                if tp_dim is not None:
                    if expect.shape[tp_dim] % 2:  # the padded vocabulary
                        expect = torch.cat([expect, torch.zeros_like(expect.narrow(tp_dim, 0, 1))], dim=tp_dim)
                    n = expect.shape[tp_dim] // 2
                    expect = expect.narrow(tp_dim, case["coords"]["tp"] * n, n)
                if data_axes:
                    n = expect.shape[zero_dim] // 2
                    expect = expect.narrow(zero_dim, case["coords"]["dp"] * n, n)
                assert torch.equal(local, expect), (rank, path)
                assert torch.equal(unpad(case["roundtrip"][path], full[path]), full[path]), path


@pytest.mark.slow
def test_vocab_parallel_cross_entropy_equals_reference():
    vocab = 11
    per_rank = run_ranks(2, "tests.sharding_workers:vocab_parallel_cross_entropy", vocab)
    logits = per_rank[0]["logits"][..., :vocab].clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), per_rank[0]["targets"].flatten(), reduction="sum")
    ref.backward()
    grad = torch.cat([r["grad"] for r in per_rank], dim=-1)
    # a log-sum-exp over the vocabulary split in two (each half's sum, then the two), summed
    # over the positions: one order against torch's; the gradient is elementwise after that
    lengths = (vocab, logits[..., 0].numel())
    for r in per_rank:
        assert_within_rounding(r["loss"], ref, lengths, what="loss")
    assert_within_rounding(grad[..., :vocab], logits.grad, lengths, scale=1.0, what="dlogits")  # |p - y| <= 1
    assert torch.all(grad[..., vocab:] == 0)


@pytest.mark.slow
def test_zero3_peak_memory_is_below_zero2():
    mib = 2**20
    r = {}
    for name, zero in (("zero2", 2), ("zero3", 3)):
        # aot_eager: the compiled step's graph (its recompute included), run op by op; the
        # inductor build of the same comparison is bench/memory.py's
        r[name] = m = run_ranks(2, "tests.sharding_workers:peak_memory", zero, True, 768, 4, 3, "aot_eager",
                                env=MEMORY_ENV)[0]
        print(f"{name}: state {m['state'] / mib:.1f} MiB + step peak {m['step'] / mib:.1f} MiB = "
              f"{(m['state'] + m['step']) / mib:.1f} MiB per rank (stored parameters {m['params'] / mib:.1f} MiB)")
    total = {name: m["state"] + m["step"] for name, m in r.items()}
    # ZeRO-3 stores half the parameters and gathers one block at a time: well below ZeRO-2,
    # whose step also holds every full gradient before reducing it
    assert total["zero3"] < total["zero2"] - r["zero2"]["params"] / 2
    assert r["zero3"]["step"] < r["zero2"]["step"]


@pytest.mark.slow
def test_sharded_checkpoint_resumes_bit_identically(tmp_path):
    r = run_ranks(2, "tests.sharding_workers:resume", str(tmp_path / "ckpt"), 3)[0]
    assert r["got"] == r["expected"] and r["params_equal"]
