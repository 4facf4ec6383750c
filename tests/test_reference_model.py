"""A run may hold a frozen second parameter tree (a reference model or a teacher), sharded
by the same plan, whose outputs an objective reads (fxmega.training.reference): the hook
DPO and distillation build on. Tested with LogitPull (tests/reference_workers.py), which
pulls the logits toward the reference model's: its loss and gradient norm equal a float64
computation of the same formula, the reference stays as loaded, tp and ZeRO-3 equal one
device, and what cannot work is refused before anything is built."""

import pytest
import torch

from fxmega.config import override
from fxmega.core import tree
from fxmega.core.errors import CheckpointError, ConfigError
from fxmega.models import gpt, model_for
from fxmega.ops.init import init_params
from fxmega.parallel.strategy import run_plan
from fxmega.training.checks import check_reference
from fxmega.training.run import Run
from tests.multirank import run_ranks
from tests.parity import assert_matches_one_device, record
from tests.reference_workers import LogitPull
from tests.sharding_workers import AOT_EAGER, tiny_config
from tests.tiers import inductor_in_e2e
from tests.tolerance import run_rtol

REFERENCE_SEED = 1  # the reference is another initialisation (seed 1); the trained model starts at seed 0


@pytest.fixture(scope="module")
def reference_ckpt(tmp_path_factory) -> str:
    """A checkpoint of the tiny GPT at seed 1's initialisation."""
    root = tmp_path_factory.mktemp("reference") / "ckpt"
    Run(override(tiny_config(compile=False), [f"train.seed={REFERENCE_SEED}"])).save(str(root))
    return str(root)


def _float64_pull(params: dict, reference: dict, batch: list[dict], cfg) -> tuple[float, float]:
    """LogitPull's loss over a global batch and the norm of its gradient, in float64."""
    p64 = tree.map_leaves(lambda t: t.detach().double().requires_grad_(), params)
    r64 = tree.map_leaves(lambda t: t.detach().double(), reference)
    inputs = torch.cat([b["inputs"] for b in batch])
    diff = gpt.forward(p64, inputs, cfg.model) - gpt.forward(r64, inputs, cfg.model)
    loss = 0.5 * diff.pow(2).sum() / inputs.numel()
    grads = torch.autograd.grad(loss, tree.leaves(p64))
    return float(loss.detach()), float(torch.sqrt(sum(g.pow(2).sum() for g in grads)))


def test_the_objective_reads_the_frozen_reference_in_the_compiled_step(reference_ckpt):
    cfg = tiny_config(extra=inductor_in_e2e())  # compiled (inductor under make e2e); 2 micro batches per step
    run = Run(cfg, objective=LogitPull(), reference=reference_ckpt)
    reference = init_params(run.specs, REFERENCE_SEED, torch.device("cpu"))
    assert all(torch.equal(a, b) and not a.requires_grad for a, b in
               zip(tree.leaves(run.reference), tree.leaves(reference)))
    micros, _ = run.host_batch(0)
    want_loss, want_norm = _float64_pull(run.params, reference, micros, cfg)
    first = run.do_step()
    # a float64 computation of the same formula stands in for the other summation order
    assert first["loss"] == pytest.approx(want_loss, rel=run_rtol(cfg, 1))
    assert first["grad_norm"] == pytest.approx(want_norm, rel=run_rtol(cfg, 1))
    later = [run.do_step()["loss"] for _ in range(4)]
    assert later[-1] < 0.8 * first["loss"]  # pulled toward the reference
    # frozen: not an optimizer input, never written
    assert all(torch.equal(a, b) for a, b in zip(tree.leaves(run.reference), tree.leaves(reference)))
    assert len(run.opt_state["exp_avg"]) == len(tree.leaves(run.params))
    assert run.evaluate() > 0  # evaluation runs the same objective


def test_what_cannot_work_is_refused(reference_ckpt):
    cfg = tiny_config(compile=False)
    with pytest.raises(ConfigError, match="logit-pull objective reads a reference model's outputs"):
        Run(cfg, objective=LogitPull())
    with pytest.raises(ConfigError, match="causal-lm objective does not read one"):
        Run(cfg, reference=reference_ckpt)
    with pytest.raises(ConfigError, match="compute.loss_chunk=16"):
        Run(override(cfg, ["compute.loss_chunk=16"]), objective=LogitPull(), reference=reference_ckpt)
    piped = override(cfg, ["parallel.mesh=pp=2"])
    with pytest.raises(ConfigError, match="not supported with pipeline parallelism"):
        check_reference(piped, run_plan(piped, model_for(cfg.model)), LogitPull(), reference_ckpt)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        Run(cfg, objective=LogitPull(), reference=reference_ckpt + "-missing")


@pytest.mark.slow
def test_tp_and_zero3_equal_one_device(reference_ckpt):
    steps = 3
    cfg = tiny_config(extra=AOT_EAGER)
    one = record(Run(cfg, objective=LogitPull(), reference=reference_ckpt), steps)
    got = run_ranks(2, "tests.reference_workers:on_meshes", ["tp2", "zero3"], reference_ckpt, steps)[0]
    for name, result in got.items():
        assert result["reference_unchanged"], name
        assert_matches_one_device(result, one, cfg, name)
