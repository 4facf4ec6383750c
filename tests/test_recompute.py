"""Activation recompute: every mode gives the loss and gradients of no recompute, inside the
compiled step too, and each mode lowers the compiled forward+backward's peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fxmega.config import load, override  # noqa: E402
from fxmega.core import tree  # noqa: E402
from fxmega.ops import recompute  # noqa: E402
from fxmega.parallel import zero3  # noqa: E402
from fxmega.training.run import Run  # noqa: E402
from fxmega.training.step import compiled, enable_autograd_in_compile  # noqa: E402
from tests.tolerance import assert_within_rounding, run_lengths  # noqa: E402

MODES = ("none", "selective", "full")


def _grads(model: str, mode: str, backend: str | None, extra: tuple = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cfg = override(load(ROOT / "configs" / f"{model}.py"),
                   ["train.compile=false", "train.device=cpu", f"compute.recompute={mode}", *extra])
    run = Run(cfg)
    flat = tree.leaves(run.params)
    batch = run.train_data.global_batch(0, cfg.train.global_batch_size)

    def loss_and_grads(flat: list[torch.Tensor], batch: dict) -> tuple:
        loss = run.loss_sum(flat, batch)
        return loss.detach(), torch.autograd.grad(loss, flat)

    fn = loss_and_grads
    if backend is not None:
        enable_autograd_in_compile()
        torch._dynamo.reset()
        fn = torch.compile(loss_and_grads, fullgraph=True, backend=backend)
    loss, grads = fn(flat, batch)
    return loss, list(grads)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_gpt", "tiny_llama"])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_recompute_modes_equal_no_recompute(model, backend):
    ref_loss, ref_grads = _grads(model, "none", None)
    lengths = run_lengths(load(ROOT / "configs" / f"{model}.py"))
    for mode in ("selective", "full"):
        loss, grads = _grads(model, mode, backend, ("compute.recompute_layers=1",) if mode == "full" else ())
        # eager recompute repeats the same ops (equal up to nothing); compiled, the graph may
        # fuse them in another order: one step's reductions times eps. Gradients near zero
        # are bounded against the largest gradient of their tensor.
        assert_within_rounding(loss, ref_loss, lengths, what=f"{mode} loss")
        for g, r in zip(grads, ref_grads):
            assert_within_rounding(g, r, lengths, what=f"{mode} gradient")


@pytest.mark.slow
def test_recompute_lowers_peak_memory_of_the_compiled_step():
    # One fresh process per mode (memory freed by one must not hide another's), run side by
    # side. glibc returns freed blocks above 64 KiB to the system at once (set before each
    # process starts: glibc reads it once), so the resident set follows the live tensors.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "OMP_NUM_THREADS": "1"}
    procs = {mode: subprocess.Popen([sys.executable, __file__, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**env, "TORCHINDUCTOR_CACHE_DIR": str(ROOT / ".cache" / f"inductor-{mode}")},
                                    text=True) for mode in MODES}
    peaks, predicted = {}, {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        peaks[mode], predicted[mode] = result["step_bytes"], result["predicted"]
    mib = {m: round(p / 2**20, 1) for m, p in peaks.items()}
    print(f"compiled forward+backward, peak above the resident set before it (MiB): {mib}; predicted by "
          f"fxmega.planning.estimate: { {m: round(p / 2**20, 1) for m, p in predicted.items()} }")
    assert peaks["none"] > peaks["selective"] > peaks["full"], mib
    for mode in MODES:  # the planner's activation estimate against the measured peak
        assert 0.85 <= predicted[mode] / peaks[mode] <= 1.15, (mode, mib, predicted)


def _measure(mode: str) -> dict:
    """Peak memory of a compiled (inductor) forward+backward whose activations dominate: a
    4-block GPT, d=64, 8 sequences of 256 tokens (the parameters are 0.8 MiB)."""
    from fxmega.core.memory import current_bytes, peak_bytes, reset_peak

    torch.set_num_threads(1)
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["train.compile=false", "train.device=cpu", "train.seq_len=256", "model.max_seq_len=256",
                    "model.n_layers=4", "train.micro_batch_size=8", f"compute.recompute={mode}"])
    run = Run(cfg)
    flat = tree.leaves(run.params)
    batch = run.train_data.global_batch(0, cfg.train.global_batch_size)
    enable_autograd_in_compile()

    def loss_and_grads(flat: list[torch.Tensor], batch: dict) -> tuple:
        loss = run.loss_sum(flat, batch)
        return loss.detach(), torch.autograd.grad(loss, flat)

    fn = compiled(loss_and_grads, options=recompute.inductor_options(mode != "none"))  # as fxmega's step
    fn(flat, batch)  # compile and warm up
    reset_peak(run.device)
    before = current_bytes(run.device)
    out = fn(flat, batch)
    step = peak_bytes(run.device) - before
    del out
    from tests.estimate_workers import predicted

    pred = predicted(cfg)
    return {"mode": mode, "step_bytes": step, "predicted": pred.activations + pred.transient + pred.compute_copy}


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1])))
    sys.stdout.flush()
    os._exit(0)


def test_zero3_checkpoint_recomputes_made_tensors_and_never_redraws():
    """ZeRO-3's checkpoint policy: a tensor made from a shape and what an eager composite
    writes into it in place (F.one_hot: zeros, then scatter_) are made again; a random draw,
    in place or not, is kept."""
    policy = zero3._POLICIES["none"]
    ops = torch.ops.aten
    idx = torch.zeros(3, 1, dtype=torch.long)
    assert policy(None, ops.zeros.default, [3, 4]) == CheckpointPolicy.MUST_RECOMPUTE
    assert policy(None, ops.scatter_.value, torch.zeros(3, 4), 1, idx, 1) == CheckpointPolicy.MUST_RECOMPUTE
    assert policy(None, ops.bernoulli_.float, torch.zeros(3), 0.5) == CheckpointPolicy.MUST_SAVE
    assert policy(None, ops.rand.default, [3]) == CheckpointPolicy.MUST_SAVE
    assert policy(None, ops.mm.default, torch.zeros(2, 2), torch.zeros(2, 2)) == CheckpointPolicy.MUST_SAVE
