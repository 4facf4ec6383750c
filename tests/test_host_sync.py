"""The training loop never waits for the device between log steps: no loss, gradient norm,
finite flag or loss scale is read back to the host except at the steps it reports (log,
eval and save steps, the first and the last), and then in one read.

On CPU there is no asynchronous device to stall, so the check counts what would stall a
GPU: every Python-level read of a tensor's value (``item``, ``float``, ``bool``,
``tolist``, ...; ``torch.cuda.set_sync_debug_mode`` is the GPU's equivalent, run by
``bench/gpu.sh``)."""

from __future__ import annotations

import pytest
import torch

from fxmega.config import load, override
from fxmega.core.errors import ConfigError
from fxmega.training.run import Run
from fxmega.training.train import train
from tests.conftest import ROOT

READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__", "__format__")


@pytest.mark.parametrize("model,extra", [
    # the compiled step (aot_eager: what matters is the host side around it, not its kernels)
    ("tiny_gpt", ["train.compile=true", "train.compile_backend=aot_eager"]),
    ("tiny_gpt", ["compute.precision=fp16", "compute.hysteresis=1", "compute.loss_scale_window=3"]),  # the scaler
    ("tiny_moe", []),  # router statistics ride along with the loss
], ids=["fp32", "fp16-loss-scaling", "moe"])
def test_the_loop_reads_the_device_only_at_the_steps_it_reports(monkeypatch, model, extra):
    # eager unless asked: eager model code would count its own reads too. peak_flops given: no fp16 matmul
    # timing on the CPU
    cfg = override(load(ROOT / "configs" / f"{model}.py"),
                   ["train.compile=false", "train.device=cpu", "train.peak_flops=1e12", "train.steps=9",
                    "train.log_interval=4", "train.eval_interval=0", "train.eval_iters=1", "train.sample_tokens=0",
                    *extra])
    reads: dict[int, list[str]] = {}
    at = {"step": 0}
    launch = Run.launch_step

    def counted(name: str, original):
        def read(self, *args, **kwargs):
            reads.setdefault(at["step"], []).append(name)
            return original(self, *args, **kwargs)
        return read

    def launch_and_count(run: Run):
        at["step"] = run.step + 1  # reads while launching or settling step s count for s
        pending = launch(run)
        if run.step == 1:  # after the first step compiled: count from here on (dynamo traces these methods)
            for name in READS:
                monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        return pending

    monkeypatch.setattr(Run, "launch_step", launch_and_count)
    result = train(cfg, progress=False)
    monkeypatch.undo()
    assert len(result.losses) == 9
    # step 1 (compiled; its time is reported), log steps 4 and 8, step 9 (the last: eval, log)
    assert set(reads) <= {1, 4, 8, 9}, {s: r for s, r in reads.items() if s not in (1, 4, 8, 9)}
    assert reads[4] == ["tolist"] and reads[8] == ["tolist"]  # one read for the whole interval
    if "compute.precision=fp16" in extra:
        assert result.run.scaler.scale < 2.0**32  # the device-side scaler acted (2^32 overflows at first)


def test_cuda_graphs_are_refused_off_a_cuda_device():
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.device=cpu", "train.cuda_graphs=true"])
    with pytest.raises(ConfigError, match="train.cuda_graphs=true replays .* this run is on cpu"):
        Run(cfg)
