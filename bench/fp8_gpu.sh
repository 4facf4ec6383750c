#!/usr/bin/env bash
# fp8 on a GPU (issue: fp8 training through torchao): bf16, fp8 tensorwise and fp8 rowwise tokens/s
# and MFU for GPT-2 124M and a Llama of 1.1B parameters, fxmega's compiled step against plain compiled
# PyTorch (with torchao's Float8Linear for the fp8 rows, torchtitan's way) in the same process.
# MFU is against the card's bf16 peak for every row, as torchtitan reports fp8 runs.
# Usage: bash bench/fp8_gpu.sh OUT_DIR   (from the repository root; needs torchao: pip install 'fxmega[fp8]')
# Six runs of two compiles each; sized for a lent GPU's 10 minutes (measured CPU-only so far).
set -uo pipefail
out=${1:-/tmp/fxmega-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import torchao" 2>/dev/null; then
  echo "fp8 rows not run: torchao is not installed here (pip install 'fxmega[fp8]')" | tee "$out/fp8.txt"
  exit 1
fi
python3 -c "import torch; print(torch.cuda.get_device_name(0), 'compute capability', torch.cuda.get_device_capability(0))" \
  | tee "$out/fp8.txt"
for preset in gpt2 llama1b; do
  for recipe in off tensorwise rowwise; do
    echo "== $preset, bf16, fp8 $recipe" | tee -a "$out/fp8.txt"
    python3 bench/step.py --device cuda --precision bf16 --preset "$preset" --fp8 "$recipe" --no-eager \
      --warmup 2 --rounds 2 --steps 5 2>&1 | tail -4 | tee -a "$out/fp8.txt"
  done
done
