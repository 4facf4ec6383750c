#!/usr/bin/env bash
# The GPU checks behind the GPU numbers in docs/benchmarks.md, in one script (a lent GPU has minutes,
# not hours): compiled vs eager on CUDA, no host sync between log steps, the default run, the step
# benchmark (bf16 MFU, CUDA graphs, the nanoGPT shape) and memory.
# Usage: bash bench/gpu.sh OUT_DIR   (runs from the repository root, no install needed)
set -uo pipefail
out=${1:-/tmp/fxmega-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/env.txt"
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0))
PY
echo "== compiled vs eager on CUDA (tiny GPT and tiny Llama, 10 steps each)"
python3 - <<'PY' 2>&1 | tee "$out/parity.txt"
import torch
from torch._dynamo.utils import counters
from fxmega.config import load, override
from fxmega.training.run import Run
for name in ("configs/tiny_gpt.py", "configs/tiny_llama.py"):
    cfg = override(load(name), ["train.device=cuda", "train.steps=10"])
    losses = {}
    for compiled in (False, True):
        counters.clear()
        run = Run(override(cfg, [f"train.compile={compiled}"]))
        losses[compiled] = [run.do_step()["loss"] for _ in range(10)]
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses[True], losses[False]))
    print(name, "eager", [round(x, 5) for x in losses[False][::3]], "compiled", [round(x, 5) for x in losses[True][::3]],
          "max rel diff", f"{diff:.2e}", "graphs", counters["stats"]["unique_graphs"])
PY
echo "== no host sync between log steps (torch.cuda.set_sync_debug_mode('error') over launched steps, prefetch on)"
python3 - <<'PY' 2>&1 | tee "$out/host_sync.txt"
import torch
from fxmega.config import load, override
from fxmega.training.run import Run
for name, extra in (("configs/tiny_gpt.py", []), ("configs/tiny_llama.py", ["compute.precision=fp16"])):
    run = Run(override(load(name), ["train.device=cuda", "train.steps=12", *extra]))
    run.do_step(); run.do_step()  # compiled, warm
    run.prefetch(2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = [run.launch_step() for _ in range(8)]
        verdict = "no host sync in 8 launched steps"
    except RuntimeError as e:
        verdict = f"SYNC: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = run.settle(pending) if verdict.startswith("no") else []
    run.stop_prefetch()
    print(name, extra, verdict, "losses", [round(o["loss"], 4) for o in out][::3])
PY
echo "== sharded init by position: CUDA's values equal the CPU's bit for bit (fxmega/ops/counter_random.py)"
python3 - <<'PY' 2>&1 | tee "$out/init_cuda_cpu.txt"
import torch
from fxmega.ops.counter_random import normal_at
index = torch.arange(10_000_000)
cpu, cuda = normal_at(1234, index), normal_at(1234, index.cuda()).cpu()
print("equal" if torch.equal(cpu, cuda) else f"DIFFER at {int((cpu != cuda).sum())} of {index.numel()} values")
PY
echo "== default run on CUDA (shakespeare_gpt, 800 steps)"
python3 run.py --config configs/shakespeare_gpt.py --device cuda --no-progress --set train.save_dir= \
  --set train.tensorboard_dir= --log-jsonl "$out/shakespeare.jsonl" 2>&1 | grep -v "^step .*|" | tail -25 | tee "$out/shakespeare.txt"
echo "== step benchmark, fp32 with TF32 matmuls, GPT-2 124M shape"
python3 bench/step.py --device cuda --tf32 --d-model 768 --layers 12 --heads 12 --vocab 50304 --seq 1024 --batch 8 \
  2>&1 | tail -6 | tee "$out/bench_124m.txt"
echo "== step benchmark, small GPT (launch-overhead bound)"
python3 bench/step.py --device cuda --tf32 --d-model 256 --layers 4 --heads 8 --vocab 4096 --seq 256 --batch 16 \
  2>&1 | tail -6 | tee "$out/bench_small.txt"
echo "== mixed precision and kernels on CUDA: bf16/fp16 track fp32, triton kernels equal reference (tiny Llama/GPT)"
python3 - <<'PY' 2>&1 | tee "$out/precision_kernels.txt"
import torch
from fxmega.config import load, override
from fxmega.training.run import Run
for name in ("configs/tiny_gpt.py", "configs/tiny_llama.py"):
    base = override(load(name), ["train.device=cuda", "train.steps=20"])
    runs = {}
    for label, extra in (("fp32", []), ("bf16", ["compute.precision=bf16"]),
                         ("fp16", ["compute.precision=fp16", "compute.initial_loss_scale=4096"]),
                         ("bf16+triton+chunked", ["compute.precision=bf16", "compute.kernels=triton", "compute.loss_chunk=128"]),
                         ("fp32+triton+chunked", ["compute.kernels=triton", "compute.loss_chunk=128"]),
                         ("fp32 full recompute", ["compute.recompute=full"])):
        torch._dynamo.reset()
        run = Run(override(base, extra))
        runs[label] = [run.do_step()["loss"] for _ in range(20)]
    for label, losses in runs.items():
        diff = max(abs(a - b) for a, b in zip(losses, runs["fp32"]))
        print(name, f"{label:<22}", "first/last", round(losses[0], 4), round(losses[-1], 4), "max |diff| vs fp32", f"{diff:.2e}")
PY
echo "== step benchmark, bf16, GPT-2 124M at seq 1024 (MFU goal: >= 50% on an H200, ahead of plain compiled)"
python3 bench/step.py --device cuda --precision bf16 --d-model 768 --layers 12 --heads 12 --vocab 50304 --seq 1024 \
  --batch 16 --rounds 4 2>&1 | tail -6 | tee "$out/bench_124m_bf16.txt"
python3 bench/step.py --device cuda --precision bf16 --kernels triton --loss-chunk 4096 --d-model 768 --layers 12 \
  --heads 12 --vocab 50304 --seq 1024 --batch 16 --rounds 4 2>&1 | tail -6 | tee "$out/bench_124m_bf16_triton.txt"
echo "== CUDA graphs (train.cuda_graphs): the launch-bound small GPT and GPT-2 124M bf16"
python3 bench/step.py --device cuda --tf32 --cuda-graphs --d-model 256 --layers 4 --heads 8 --vocab 4096 --seq 256 \
  --batch 16 2>&1 | tail -6 | tee "$out/bench_small_cudagraphs.txt"
python3 bench/step.py --device cuda --precision bf16 --cuda-graphs --preset gpt2 --batch 16 --rounds 4 2>&1 | tail -6 \
  | tee "$out/bench_124m_bf16_cudagraphs.txt"
echo "== the nanoGPT-shaped model of the CPU table, on the GPU"
python3 bench/step.py --device cuda --tf32 --preset nanogpt 2>&1 | tail -6 | tee "$out/bench_nanogpt.txt"
echo "== memory by precision and recompute (CUDA allocator peaks)"
python3 bench/memory.py --d-model 768 --layers 12 --seq 1024 --batch 8 2>&1 | tail -12 | tee "$out/memory.txt"
echo "== fp8 through torchao: bf16, tensorwise, rowwise, GPT-2 124M and Llama 1.1B (bench/fp8_gpu.sh)"
bash bench/fp8_gpu.sh "$out"
