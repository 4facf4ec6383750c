"""Pipeline parallelism: stage splits and their errors (pure data), every schedule on 2
gloo ranks against the single-device run, pp composed with dp/ZeRO-1 and tp/SP on 4 and
8 ranks, and the tied embedding staying identical on the first and last stage.

Compiling 8 ranks on 2 cores takes ~5 minutes, so the composed runs are eager; one
compiled 1F1B run shows the compiled stages give the same losses."""

from __future__ import annotations

import pytest
import torch

from fxmega.cli import main
from fxmega.config import ParallelConfig
from fxmega.core.errors import ConfigError
from fxmega.models import gpt
from fxmega.parallel.strategy import plan_from
from fxmega.sharding.pipeline import balanced_counts, check_microbatches, make_pipeline, parse_layout
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device, record
from tests.pipeline_workers import FOUR_BLOCKS, masked_run
from tests.sharding_workers import tiny_config
from tests.tiers import inductor_in_e2e
from tests.tolerance import assert_losses_match, run_rtol

STEPS = 5
MICRO2 = ("train.micro_batch_size=2",)  # 4 microbatches of 2 per step on one data rank


# -- stage splits (no processes) --------------------------------------------------------
def test_balanced_split_counts_the_head():
    cfg = gpt.Config()  # GPT-2 124M: the tied head projects onto 50,257 tokens
    plan = plan_from(gpt.param_specs(cfg), ParallelConfig(mesh="pp=4"), gpt.FAMILY)
    pipe = plan.pipeline
    head = (50257 * 768 + 2 * 768) / 7087872  # tied projection + final norm, in blocks (~5.4)
    assert [len(s.blocks) for s in pipe.stages] == [3, 4, 4, 1]  # the last stage also carries the head
    assert pipe.stages[0].embed and pipe.stages[-1].head and pipe.costs[-1] == pytest.approx(1 + head, rel=1e-6)
    assert max(pipe.costs) < 3 + head  # what an even 3/3/3/3 split would give the last stage
    assert balanced_counts(8, 4, 0.0, 0.0) == [2, 2, 2, 2]


def test_interleaved_stages_go_round_robin():
    pipe = make_pipeline(8, 2, 2, "interleaved-1f1b", "", 0.0, 0.0)
    assert [(s.index, s.rank, s.blocks) for s in pipe.stages] == [(0, 0, (0, 1)), (1, 1, (2, 3)), (2, 0, (4, 5)),
                                                                  (3, 1, (6, 7))]
    assert [s.index for s in pipe.stages_of(0)] == [0, 2]


def test_manual_layout():
    assert parse_layout("Et*3|t*4|tt,tL", 3, 10) == [(True, 3, False), (False, 4, False), (False, 3, True)]
    pipe = make_pipeline(4, 2, 1, "1f1b", "E|t*4L", 0.0, 1.0)
    assert pipe.stages[0].blocks == () and pipe.stages[1].blocks == (0, 1, 2, 3)  # empty stages are allowed
    for layout, msg in [("Et*3|t", "places 4 blocks; the model has 5"), ("Et|t|tL", "has 3 stages"),
                        ("t*2|Et*3L", "embedding E must be in the first stage"),
                        ("Et*2L|t*3", "head L must be in the last stage"), ("Et*2|x*3L", "stage 1 has 'x'")]:
        with pytest.raises(ConfigError, match=msg):
            make_pipeline(5, 2, 1, "1f1b", layout, 0.0, 1.0)


def test_impossible_splits_and_schedules_are_clear_errors():
    for args, msg in [((2, 2, 2, "interleaved-1f1b"), "4 pipeline stages need at least 4 blocks, but the model has 2"),
                      ((8, 2, 2, "1f1b"), "runs one stage per rank, but --virtual-stages is 2"),
                      ((8, 2, 1, "interleaved-1f1b"), "needs --virtual-stages 2 or more"),
                      ((8, 2, 1, "pipedream"), "schedule 'pipedream' is unknown")]:
        with pytest.raises(ConfigError, match=msg):
            make_pipeline(*args, "", 0.0, 1.0)
    with pytest.raises(ConfigError, match="needs at least pp=4 microbatches per step, but the batch gives 2"):
        check_microbatches("1f1b", 2, 4, 1)
    with pytest.raises(ConfigError, match="9 microbatches do not split into 2 equal rounds: use a multiple of 4"):
        check_microbatches("interleaved-1f1b", 9, 4, 2)
    check_microbatches("gpipe", 1, 4, 1)  # GPipe takes any count
    with pytest.raises(ConfigError, match="gradients sharded over the data axes .* Use --zero 1"):
        plan_from(gpt.param_specs(gpt.Config(n_layers=4)), ParallelConfig(mesh="dp=2,pp=2", rules="zero2"), gpt.FAMILY)


def test_explain_shows_the_stage_map(capsys):
    assert main(["plan", "--config", str(ROOT / "configs" / "llama2_7b.py"), "--mesh", "8x4x2", "--rules", "zero1",
                 "--pipeline-schedule", "interleaved-1f1b", "--virtual-stages", "2", "--global-batch-size", "64",
                 "--micro-batch-size", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 ranks x 2 virtual = 4 stages, schedule interleaved-1f1b" in out
    assert "stage 0 on pp rank 0: E, blocks 0-7 " in out and "stage 3 on pp rank 1: blocks 24-31, L " in out
    assert "pp rank 0: parameters" in out and "pp rank 1: parameters" in out
    assert "@ pp 1" in out  # the head lives on the last stage's rank


# -- training on gloo ranks ---------------------------------------------------------------
SCHEDULE_RUNS = [
    ("gpipe", dict(mesh="pp=2", pipeline_schedule="gpipe"), False, MICRO2),
    ("1f1b", dict(mesh="pp=2"), False, MICRO2),
    ("interleaved-1f1b", dict(mesh="pp=2", pipeline_schedule="interleaved-1f1b", virtual_stages=2), False, MICRO2),
    ("zero-bubble", dict(mesh="pp=2", pipeline_schedule="zero-bubble", virtual_stages=2), False, MICRO2),
    ("layout", dict(mesh="pp=2", pipeline_layout="Et*3|tL"), False, MICRO2),
    # inductor under make e2e, aot_eager under make test: the user-path matrix's pp_1f1b builds
    # inductor's stages through run.py (tests/tiers.py)
    ("1f1b-compiled", dict(mesh="pp=2"), True, (*MICRO2, *inductor_in_e2e())),
]


def _reference(model: str = "tiny_gpt") -> dict:
    run = Run(tiny_config(compile=False, extra=FOUR_BLOCKS + MICRO2, model=model))
    return {**record(run, STEPS), "valid": run.evaluate()}


@pytest.fixture(scope="module")
def reference():
    return _reference()


@pytest.fixture(scope="module")
def schedules():
    return run_ranks(2, "tests.pipeline_workers:pipelined", SCHEDULE_RUNS, STEPS)


def _matches(result: dict, reference: dict, name: str) -> None:
    cfg = tiny_config(extra=FOUR_BLOCKS + MICRO2)
    # stages and micro batches sum in other orders: losses, gradient norms, every gradient, parameters
    assert_matches_one_device(result, reference, cfg, name)
    assert result["valid"] == pytest.approx(reference["valid"], rel=run_rtol(cfg, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("name", [r[0] for r in SCHEDULE_RUNS])
def test_schedule_matches_single_device(schedules, reference, name):
    _matches(schedules[0][name], reference, name)


@pytest.mark.slow
def test_compiled_stages_compile_once(schedules):
    # per rank: the stage function and the update graph, each compiled once for all steps
    assert [schedules[r]["1f1b-compiled"]["graphs"] for r in (0, 1)] == [2, 2]
    assert schedules[0]["1f1b"]["graphs"] == 0  # eager runs compile nothing


@pytest.mark.slow
def test_every_schedule_gives_the_same_loss(schedules):
    losses = [schedules[0][name]["losses"] for name, *_ in SCHEDULE_RUNS]
    for other in losses[1:]:  # the schedules order the same micro batches' sums differently
        assert_losses_match(other, losses[0], tiny_config(extra=FOUR_BLOCKS + MICRO2))


@pytest.mark.slow
def test_tied_embedding_stays_identical_on_first_and_last_stage(schedules):
    first, last = schedules[0]["1f1b"]["local"], schedules[1]["1f1b"]["local"]
    blocks = lambda local: {p.split(".")[1] for p in local if p.startswith("blocks.")}  # noqa: E731
    assert blocks(first) == {"0", "1"} and blocks(last) == {"2", "3"}  # each rank holds its own blocks only
    assert "final_norm.scale" in last and "final_norm.scale" not in first
    assert torch.equal(first["embed.tokens"], last["embed.tokens"])  # summed gradients, the same update


@pytest.mark.slow
def test_tied_embedding_is_summed_between_first_and_last_stage_only(reference):
    # pp=3: the tied embedding lives on pp ranks 0 and 2; rank 1 holds only blocks
    results = run_ranks(3, "tests.pipeline_workers:pipelined", [("pp3", dict(mesh="pp=3"), False, MICRO2)], STEPS)
    _matches(results[0]["pp3"], reference, "pp3")
    assert [r["pp3"]["shared_groups"] for r in results] == [[2], [], [2]]
    assert torch.equal(results[0]["pp3"]["local"]["embed.tokens"], results[2]["pp3"]["local"]["embed.tokens"])


COMPOSED = [
    ("pp2_dp2_zero1", dict(mesh="dp=2,pp=2", rules="zero1"), False, MICRO2),
    ("pp2_tp2_sp", dict(mesh="tp=2,pp=2", sequence_parallel=True), False, MICRO2),
]


@pytest.mark.slow
def test_pp_composed_with_dp_and_tp_on_four_ranks(reference):
    results = run_ranks(4, "tests.pipeline_workers:pipelined", COMPOSED, STEPS)[0]
    for name, *_ in COMPOSED:
        _matches(results[name], reference, name)


@pytest.mark.slow
def test_2x2x2_llama_with_sequence_parallel_and_zero1():
    run = [("2x2x2", dict(mesh="2x2x2", rules="zero1", sequence_parallel=True, model="tiny_llama"), False, MICRO2)]
    result = run_ranks(8, "tests.pipeline_workers:pipelined", run, STEPS)[0]["2x2x2"]
    _matches(result, _reference("tiny_llama"), "2x2x2")


@pytest.mark.slow
def test_a_partial_loss_mask_on_dp2_pp2_matches_one_device():
    # 2 micro batches per data rank and step: the masked targets leave the sum and the count
    # on every rank and micro batch, and the step divides by the global batch's count
    cfg = tiny_config(compile=False, extra=("train.micro_batch_size=2",))
    run = masked_run(cfg)
    ref = record(run, STEPS)
    assert 0 < float(run.train_data.global_batch(0, 8)["loss_mask"].mean()) < 1
    got = run_ranks(4, "tests.pipeline_workers:partial_loss_mask", dict(mesh="dp=2,pp=2"), STEPS)[0]
    assert_matches_one_device(got, ref, cfg, "dp2 x pp2, partial loss mask")
    assert got["valid"] == pytest.approx(run.evaluate(), rel=run_rtol(cfg, STEPS + 1))


@pytest.mark.slow
def test_pipelined_checkpoint_resumes_bit_identically(tmp_path):
    # each pp rank saves its own stages' parameters and optimizer state (the tied embedding
    # from both ends); a fresh run loads them and continues with the same losses
    r = run_ranks(2, "tests.sharding_workers:resume", str(tmp_path / "ckpt"), 3, dict(mesh="pp=2"),
                  FOUR_BLOCKS + MICRO2)[0]
    assert r["got"] == r["expected"] and r["params_equal"]
