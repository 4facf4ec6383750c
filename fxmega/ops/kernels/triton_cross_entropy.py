"""Triton kernel for per-row cross-entropy and its gradient w.r.t. the logits.

Imported only when triton is installed; use it through :mod:`fxmega.ops.kernels.triton_ops`.
One program per row walks the vocabulary in blocks twice: first an online softmax (running
max and rescaled running sum, so no block of the row is held beyond its own step and V can
be 100k+), then ``softmax - onehot`` written block by block.
"""

import triton
import triton.language as tl


@triton.jit
def cross_entropy_rows_kernel(logits_ptr, targets_ptr, loss_ptr, dlogits_ptr, n_cols, vocab_size,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * n_cols
    target = tl.load(targets_ptr + row)
    running_max = float("-inf")
    running_sum = 0.0
    target_logit = 0.0
    # Pass 1 stops at vocab_size: padding columns never enter the softmax.
    for start in range(0, vocab_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_logits + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        # The first block holds column 0, so new_max is finite from the first step on and
        # exp(-inf - finite) = 0 is safe; exp(-inf - -inf) never happens.
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        # Picked with a compare rather than a pointer: no out-of-bounds read for a bad target.
        target_logit += tl.sum(tl.where(cols == target, x, 0.0), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(loss_ptr + row, lse - target_logit)
    # Pass 2 covers every column, so padding columns get an explicit 0 (exp(-inf) = 0).
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_logits + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)
        tl.store(dlogits_ptr + row * n_cols + cols, grad.to(dlogits_ptr.dtype.element_ty), mask=cols < n_cols)
