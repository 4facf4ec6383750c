#!/usr/bin/env python3
"""Training-step speed: fxmega's compiled step against plain PyTorch, in one run.

Three ways to train the same GPT on the same synthetic batches:
  1. fxmega: pure model function, forward + autograd.grad + AdamW in one torch.compile graph;
  2. plain eager: an nn.Module GPT with loss.backward() and torch.optim.AdamW (foreach);
  3. plain compiled: that module under torch.compile, optimizer step eager.
Prints tokens/s and MFU for each and fxmega's ratio to the others. ``--precision bf16``
runs fxmega with bf16 compute (fp32 masters) and plain PyTorch under bf16 autocast.

The plain model is nanoGPT's structure (fused QKV ``Linear``, SDPA, tied head; AdamW fused
where torch has it, else foreach), or with ``--family llama`` Llama's (``plain_llama.py``).
``--preset nanogpt`` is nanoGPT's small Shakespeare-char model scaled to GPT-2's vocabulary
(6 layers x 384, 6 heads, sequence 256, batch 8, vocabulary 50304); ``--preset gpt2`` is
GPT-2 124M at sequence 1024 (for a GPU); ``--preset llama1b`` a Llama of 1.1B parameters
(Llama 3.2 1B's width, depth and grouped-query heads, with Llama 2's 32000-token vocabulary).

``--fp8 tensorwise|rowwise`` runs fxmega's weight matmuls through its fp8 recipe
(``compute.fp8``) and converts the plain model's ``nn.Linear`` layers with torchao's
``convert_to_float8_training`` under the same recipe and the same filter (both weight dims
multiples of 16, not the output head): torchtitan's way, so the baseline is plain PyTorch
with torchao's fp8. MFU stays against the bf16 peak, as torchtitan reports fp8 runs.

    python bench/step.py [--preset nanogpt] [--d-model 256 --layers 4 --seq 128 --batch 8 --precision bf16]
    python bench/step.py --preset llama1b --precision bf16 --fp8 rowwise --no-eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plain_gpt import PlainGPT  # noqa: E402
from plain_llama import PlainLlama  # noqa: E402

from fxmega.config import ComputeConfig, DataConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402
from fxmega.core.precision import compute_dtype  # noqa: E402
from fxmega.models import gpt, llama  # noqa: E402
from fxmega.ops.fp8 import RECIPES, Fp8Filter, emulated  # noqa: E402
from fxmega.ops.init import count_params  # noqa: E402
from fxmega.training.metrics import device_peak, model_flops_per_token  # noqa: E402
from fxmega.training.run import Run  # noqa: E402


def interleaved(step_fns: dict, steps: int, warmup: int, rounds: int, sync) -> dict[str, list[float]]:
    """Step times per method, measured in alternating rounds so that drift in the machine's
    speed (shared CPUs, frequency changes) falls on every method alike."""
    for fn in step_fns.values():
        for i in range(warmup):
            fn(i)
            sync()
    times: dict[str, list[float]] = {name: [] for name in step_fns}
    for r in range(rounds):
        for name, fn in step_fns.items():
            for i in range(steps):
                t0 = time.perf_counter()
                fn(r * steps + i)
                sync()
                times[name].append(time.perf_counter() - t0)
    return times


PRESETS = {  # shapes named in the README's table
    "nanogpt": {"d_model": 384, "layers": 6, "heads": 6, "vocab": 50304, "seq": 256, "batch": 8},
    "gpt2": {"d_model": 768, "layers": 12, "heads": 12, "vocab": 50304, "seq": 1024, "batch": 8},
    "llama1b": {"family": "llama", "d_model": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "d_ff": 8192,
                "vocab": 32000, "seq": 2048, "batch": 4},
}


def plain_model(args: argparse.Namespace) -> torch.nn.Module:
    if args.family == "llama":
        return PlainLlama(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads or args.heads, args.d_ff)
    return PlainGPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)


def model_config(args: argparse.Namespace) -> object:
    if args.family == "llama":
        return llama.Config(vocab_size=args.vocab, max_seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.heads, n_kv_heads=args.kv_heads, d_ff=args.d_ff, rope_theta=500000.0)
    return gpt.Config(vocab_size=args.vocab, max_seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                      n_heads=args.heads)


def to_fp8(model: torch.nn.Module, recipe: str, device: torch.device) -> torch.nn.Module:
    """``model``'s linear layers as torchao's Float8Linear under ``recipe``, filtered as
    fxmega's recipe filters (``fxmega.ops.fp8.Fp8Filter``): both dims multiples of 16, not the
    output head; emulated where the device has no fp8 tensor cores, as fxmega's is."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulated(device))
    multiple = Fp8Filter().multiple

    def accepts(module: torch.nn.Module, fqn: str) -> bool:
        return fqn != "head" and all(d % multiple == 0 for d in module.weight.shape)

    return convert_to_float8_training(model, config=config, module_filter_fn=accepts)


def fused_or_foreach(device: torch.device) -> dict[str, bool]:
    """nanoGPT's choice: the fused AdamW kernel where this torch has one for the device."""
    try:
        torch.optim.AdamW([torch.zeros(1, device=device, requires_grad=True)], fused=True)
        return {"fused": True}
    except RuntimeError:
        return {"foreach": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named shape (overrides the shape options)")
    ap.add_argument("--family", default="gpt", choices=["gpt", "llama"])
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0: as many as query heads)")
    ap.add_argument("--d-ff", type=int, default=0,
                    help="llama: the MLP's hidden width (0: 8/3 d_model, rounded to 256)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per method per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per method (compilation)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (all three methods)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--kernels", default="reference", choices=["reference", "triton"])
    ap.add_argument("--loss-chunk", type=int, default=0)
    ap.add_argument("--cuda-graphs", action="store_true", help="fxmega's step as CUDA graphs (train.cuda_graphs)")
    ap.add_argument("--fp8", default="off", choices=["off", *RECIPES],
                    help="fxmega's fp8 recipe, and torchao's Float8Linear with it in the plain model")
    ap.add_argument("--no-eager", action="store_true", help="leave out the plain eager model (time on a lent GPU)")
    args = ap.parse_args()
    if args.preset:
        vars(args).update(PRESETS[args.preset])
    if args.family == "llama" and not args.d_ff:
        args.d_ff = (8 * args.d_model // 3 + 255) // 256 * 256
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens_per_step = args.batch * args.seq

    cfg = RunConfig(
        model=model_config(args),
        train=TrainConfig(steps=10**6, micro_batch_size=args.batch, global_batch_size=args.batch,
                          seq_len=args.seq, device=args.device, cuda_graphs=args.cuda_graphs),
        optim=OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant", clip_grad=0.0),
        data=DataConfig(source="mock"),
        compute=ComputeConfig(precision=args.precision, kernels=args.kernels, loss_chunk=args.loss_chunk,
                              fp8=args.fp8),
    )
    run = Run(cfg)
    autocast_dtype = compute_dtype(args.precision)
    batches = [run.train_data.global_batch(i, args.batch) for i in range(4)]
    step_fns = {"fxmega compiled step": lambda i: run.do_step()}
    adamw_kind = fused_or_foreach(device)
    plain = (("plain nn.Module eager", False), ("plain nn.Module compiled", True))
    for name, compile_model in plain[1:] if args.no_eager else plain:
        torch.manual_seed(0)
        model = plain_model(args).to(device)
        if args.fp8 != "off":
            model = to_fp8(model, args.fp8, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **adamw_kind)
        fwd = torch.compile(model) if compile_model else model

        def plain_step(i: int, fwd=fwd, opt=opt) -> None:
            b = batches[i % len(batches)]
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=args.precision != "fp32"):
                loss = fwd(b["inputs"].to(device), b["targets"].to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()

        step_fns[name] = plain_step
    results = interleaved(step_fns, args.steps, args.warmup, args.rounds, sync)

    ours = tokens_per_step / statistics.median(results["fxmega compiled step"])
    flops = model_flops_per_token(run.specs, cfg.model, args.seq)
    peak = device_peak(device, autocast_dtype)
    shape = f"kv_heads={args.kv_heads or args.heads} d_ff={args.d_ff} " if args.family == "llama" else ""
    print(f"\n{args.family.upper()} d_model={args.d_model} layers={args.layers} heads={args.heads} {shape}"
          f"vocab={args.vocab} seq={args.seq} batch={args.batch}, {args.precision}"
          f"{'' if args.fp8 == 'off' else f' + fp8 {args.fp8} (torchao in the plain model)'}, "
          f"kernels {args.kernels}, {count_params(run.specs) / 1e6:,.1f}M parameters, {device}, "
          f"plain AdamW {'fused' if 'fused' in adamw_kind else 'foreach'}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; MFU against "
          f"{peak.flops / 1e12:.1f} TFLOP/s ({peak.source})")
    print(f"{'method':<28}{'median step ms':>16}{'tokens/s':>12}{'MFU':>8}{'fxmega is':>12}")
    for name, times in results.items():
        rate = tokens_per_step / statistics.median(times)
        mfu = rate * flops / peak.flops
        print(f"{name:<28}{1000 * statistics.median(times):>16.1f}{rate:>12,.0f}{100 * mfu:>7.1f}%"
              f"{ours / rate:>11.2f}x")


if __name__ == "__main__":
    main()
