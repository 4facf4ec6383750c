"""fp8 training matmuls (``compute.fp8``, ``fxmega.ops.fp8``) through torchao, emulated on
CPU: each recipe's forward and backward equal a float64 reference of the same casts and
scales, the filter leaves the other matmuls alone, settings it cannot run are refused, and
``run.py --fp8`` trains, evaluates, saves, resumes exactly and generates."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fxmega.config import load, override
from fxmega.core.errors import ConfigError
from fxmega.models import model_for
from fxmega.models.weight_uses import weight_uses
from fxmega.ops import fp8, matmul
from fxmega.ops.matmul import WeightUse
from fxmega.training.checks import preflight
from fxmega.training.run import Run
from tests.commands import env, run_py
from tests.conftest import ROOT
from tests.tiers import E2E

pytest.importorskip("torchao")  # the fp8 extra (in the dev install, so CI runs these)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12  # torchao's EPS: the smallest amax a scale is computed from
# (recipe, the output gradient's fp8 dtype, scales per row along the reduced dim, scales rounded to 2^k)
RECIPES = {"tensorwise": (E5M2, False, False), "rowwise": (E4M3, True, True)}


def _dequantised(t: torch.Tensor, dtype: torch.dtype, dim: int | None, pow2: bool) -> torch.Tensor:
    """``t`` cast to fp8 as torchao casts it (amax over ``dim``, or all of it; scale = fp8 max /
    amax, in float64 then fp32, rounded down to a power of two with ``pow2``; values scaled in
    fp32 and saturated), read back in float64."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (torch.finfo(dtype).max / amax.double().clamp(min=AMAX_FLOOR)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    fmax = torch.finfo(dtype).max
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q.double() / scale.double()


def _reference(x: torch.Tensor, w: torch.Tensor, go: torch.Tensor, name: str):
    """The float64 output, input gradient and weight gradient of ``x @ w`` under recipe
    ``name``, with the product ``|a| @ |b|`` of each (what bounds its fp32 rounding)."""
    go_dtype, rowwise, pow2 = RECIPES[name]
    along = lambda d: d if rowwise else None  # noqa: E731
    x2, go2 = x.reshape(-1, x.shape[-1]), go.reshape(-1, go.shape[-1])
    pairs = {"out": (_dequantised(x2, E4M3, along(-1), pow2), _dequantised(w, E4M3, along(0), pow2)),
             "grad_x": (_dequantised(go2, go_dtype, along(-1), pow2), _dequantised(w, E4M3, along(-1), pow2).T),
             "grad_w": (_dequantised(x2, E4M3, along(0), pow2).T, _dequantised(go2, go_dtype, along(0), pow2))}
    return {k: (a @ b, a.abs() @ b.abs()) for k, (a, b) in pairs.items()}


@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_and_backward_equal_a_float64_reference_of_the_same_casts(name):
    torch.manual_seed(0)
    m, k, n = 24, 48, 32
    x = (torch.randn(2, m // 2, k) * torch.linspace(0.1, 10, k)).requires_grad_()  # rows and columns of unlike size
    w = (torch.randn(k, n) * 0.2).requires_grad_()
    go = torch.randn(2, m // 2, n) * torch.linspace(1e-3, 1, n)
    with matmul.use(fp8.recipe(name, emulate=True)):
        out = matmul.matmul(x, w)
    out.backward(go)
    ref = _reference(x.detach(), w.detach(), go, name)
    got = {"out": out.reshape(-1, n), "grad_x": x.grad.reshape(-1, k), "grad_w": w.grad}
    for key, (want, scale) in ref.items():
        reduced = {"out": k, "grad_x": n, "grad_w": m}[key]
        # the emulation multiplies the same fp8 values in fp32: the reduction's rounding
        # (length x eps) plus the dequantising division's, times the sum of |products|
        bound = (reduced + 2) * torch.finfo(torch.float32).eps * scale
        err = (got[key].double() - want).abs()
        assert (err <= bound).all(), f"{name} {key}: exceeds its bound by {(err - bound).max():.3g}"
    # and it is fp8: the plain fp32 product is far outside that bound (e4m3 keeps 3 mantissa bits)
    plain = (x.detach().double() @ w.detach().double()).reshape(-1, n)
    assert ((plain - ref["out"][0]).abs() > 100 * (k + 2) * torch.finfo(torch.float32).eps * ref["out"][1]).any()


def test_the_filter_leaves_other_matmuls_in_the_compute_precision():
    torch.manual_seed(0)
    x = torch.randn(4, 48)
    recipe = fp8.recipe("tensorwise", emulate=True)
    with matmul.use(recipe):
        for w, role in ((torch.randn(48, 32), "head"), (torch.randn(48, 32), "router"),
                        (torch.randn(48, 32), "expert"), (torch.randn(48, 40), "linear")):  # 40: not a multiple of 16
            assert torch.equal(matmul.matmul(x, w, role), x @ w), role
        w = torch.randn(48, 32)
        assert not torch.equal(matmul.matmul(x, w, "linear"), x @ w)
    assert fp8.recipe("tensorwise", emulate=True) is recipe  # one object: a traced step guards on it


def _cfg(*sets: str):
    return override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.micro_batch_size=2", *sets])


@pytest.mark.parametrize("name,match", [("mxfp8", "mxfp8: MX block scaling.*Blackwell"),
                                        ("nvfp4", "nvfp4: NVFP4.*Blackwell"),
                                        ("e4m3", "compute.fp8='e4m3': use one of off, tensorwise, rowwise")])
def test_recipes_it_cannot_run_are_refused(name, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(f"compute.fp8={name}").validate()


@pytest.mark.parametrize("mesh,axis", [("cp=2", "cp=2: context parallelism"),
                                       ("dp=2,ep=2", "ep=2: expert parallelism")])
def test_meshes_not_yet_shown_equal_to_one_device_are_refused(mesh, axis):
    model = "tiny_moe" if "ep" in mesh else "tiny_gpt"
    cfg = override(load(ROOT / "configs" / f"{model}.py"), ["train.micro_batch_size=2", "compute.fp8=tensorwise",
                                                             f"parallel.mesh={mesh}"])
    with pytest.raises(ConfigError, match=f"compute.fp8=tensorwise with {axis}"):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))


@pytest.mark.parametrize("sets,match", [
    (("compute.fp8=rowwise",), "fp8_gather=true with compute.fp8=rowwise: rowwise casts each weight twice"),
    ((), "set --fp8 tensorwise too"),
    (("compute.fp8=tensorwise", "parallel.rules=zero1"), "this run gathers no parameters: add --rules zero3"),
])
def test_fp8_gathers_it_cannot_make_are_refused(sets, match):
    cfg = _cfg("parallel.mesh=dp=2", "parallel.rules=zero3", "compute.fp8_gather=true", *sets)
    with pytest.raises(ConfigError, match=match):
        preflight(cfg, model_for(cfg.model), torch.device("cpu"))


@pytest.mark.slow
def test_run_py_fp8_trains_evaluates_saves_resumes_exactly_and_generates(tmp_path):
    """``run.py --fp8 rowwise --bf16`` with inductor: 2 steps saved and resumed to 4 log the
    same losses and gradient norms as 4 steps straight (the scales are recomputed from the
    restored tensors, so nothing fp8 is lost in the checkpoint). Under make test the runs trace
    with aot_eager (tests/tiers.py): inductor's fp8 kernels are built there by
    tests/test_fp8_mesh.py's run.py case (tensorwise); rowwise's under make e2e."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    common = ["--config", str(ROOT / "configs" / "tiny_gpt.py"), "--fp8", "rowwise", "--bf16", "--data-path",
              str(corpus), "--lr-decay-iters", "4", "--log-interval", "1", "--eval-interval", "2", "--no-progress",
              *(() if E2E else ("--compile-backend", "aot_eager"))]
    ckpt, log, straight = tmp_path / "ckpt", tmp_path / "log.jsonl", tmp_path / "straight.jsonl"
    first = run_py(*common, "--steps", "2", "--save", str(ckpt), "--log-jsonl", str(log))
    assert "fp8 rowwise on linear matmuls with both dims multiples of 16 (8 of 8 linear matmuls), emulated" \
        in first.stdout
    assert "step 2: validation loss" in first.stdout
    resumed = run_py(*common, "--steps", "4", "--save", str(ckpt), "--load", str(ckpt), "--log-jsonl", str(log))
    assert f"resumed from {ckpt}" in resumed.stdout and "step 4: validation loss" in resumed.stdout
    run_py(*common, "--steps", "4", "--log-jsonl", str(straight))
    logged = lambda path: [{k: r[k] for k in ("step", "loss", "grad_norm")}  # noqa: E731
                           for r in map(json.loads, path.read_text().splitlines())]
    assert logged(log) == logged(straight)
    generated = run_py("generate", "--load", str(ckpt), "--prompt", "the quick", "--max-new-tokens", "8",
                       "--temperature", "0")
    assert "the quick" in generated.stdout


def test_run_py_refuses_fp8_that_would_apply_to_no_matmul():
    """``--fp8`` on a model whose linear widths are not multiples of 16 (d_model 72) would run
    every matmul in the compute precision, bit for bit the run without it, under a header that
    says fp8: refused in one line before anything is built, with the count and the fix."""
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "--config", str(ROOT / "configs" / "tiny_gpt.py"),
                           "--fp8", "tensorwise", "--set", "model.d_model=72", "--mock-data", "--steps", "1",
                           "--no-compile"], capture_output=True, text=True, timeout=300, env=env())
    said = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in said, said[-3000:]
    assert "none of the model's 8 linear matmuls has both weight dims multiples of 16" in said
    assert "model.d_model=72" in said and "drop --fp8" in said


TRACK_STEPS = 200


def _losses(fp8_recipe: str, data_dir, seed: int = 1234) -> list[float]:
    """Eager losses of the tiny GPT on this repository's README (bytes), bf16 compute."""
    cfg = _cfg("train.compile=false", "compute.precision=bf16", f"compute.fp8={fp8_recipe}",
               f"train.steps={TRACK_STEPS}", "train.micro_batch_size=8", f"data.source={ROOT / 'README.md'}",
               f"data.data_dir={data_dir}", f"train.seed={seed}")
    run = Run(cfg)
    return [run.do_step()["loss"] for _ in range(TRACK_STEPS)]


@pytest.mark.slow
def test_200_steps_train_as_well_as_bf16(tmp_path):
    """The same data, seed and schedule in bf16 with and without fp8: the mean loss of the last
    20 steps no worse than bf16's by more than twice the spread bf16's own shows over three
    other seeds, measured here in the same run (fp8 rounding moves the trajectory by amounts
    no bound predicts step by step; a broken cast or scale lands far outside). Measured on an
    AMD EPYC, 2026-12-07: bf16 3.2156, tensorwise -2.3%, rowwise -1.9%; bf16 over seeds 1-3
    3.1433 to 3.2246 (2.5%), and fp8 against bf16 seed for seed from -5.7% to +1.2%."""
    tail = lambda losses: sum(losses[-20:]) / 20  # noqa: E731
    seeds = [tail(_losses("off", tmp_path, seed)) for seed in (1, 2, 3)]
    spread = max(seeds) - min(seeds)
    base = _losses("off", tmp_path)
    assert tail(base) < 0.6 * base[0]  # bf16 learned: from ln(256) = 5.5 to about 3.2
    for name in RECIPES:
        got = _losses(name, tmp_path)
        assert got != base  # fp8 is on
        assert tail(got) <= tail(base) + 2 * spread, (name, tail(got), tail(base), spread)


def test_fp8_gathers_take_the_weights_whose_every_matmul_casts_on_the_rank_s_slice():
    """Which weights ZeRO-3 gathers in fp8: found from the matmuls the loss runs (the tiny
    GPT's four linear weights per block; not the tied embedding, read by the lookup and the
    head), each judged on the 2-D weight a tp rank multiplies: an MLP of 96 on tp=2 leaves
    48 per rank, a multiple of 16, and of 80 leaves 40, which the recipe leaves in bf16."""
    cfg = _cfg()
    model = model_for(cfg.model)
    uses = weight_uses(cfg.model, model, model.objective(cfg.model))
    shapes = {path: uses[path][0].param_shape for path in uses}
    assert fp8.gathered_in_fp8(uses, shapes) == {f"blocks.{i}.{w}" for i in range(cfg.model.n_layers)
                                                 for w in ("attn.wqkv", "attn.wo", "mlp.w_in", "mlp.w_out")}
    d = cfg.model.d_model
    for d_ff, kept in ((96, True), (80, False)):
        mlp = WeightUse("linear", (d, d_ff), (d, d_ff))
        assert bool(fp8.gathered_in_fp8({"w": [mlp]}, {"w": (d, d_ff // 2)})) == kept
    # a [heads, head_dim, embed] weight flattened as the matmul flattens it, on its tp slice
    wo = WeightUse("linear", (4, 16, d), (64, d))
    assert wo.local_matmul_shape((2, 16, d)) == (32, d)
