"""Triton kernels for RMSNorm and LayerNorm, forward and backward (one row of ``d`` per step).

Imported only when triton is installed; use them through :mod:`fxmega.ops.kernels.triton_ops`,
which registers them as torch custom ops. Rows are contiguous (``row * d + col``). The
backward kernels recompute the row statistics from ``x`` instead of saving them: the row is
loaded anyway, so this costs no extra memory traffic and saves a ``[rows]`` tensor per norm.
Pointer offsets are int64 so that ``rows * d`` past 2**31 does not wrap.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(x_ptr, scale_ptr, y_ptr, d, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    # Hugging Face order: round the normalised row to x's dtype *before* scaling.
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * d + cols, (scale * normed).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(dy_ptr, x_ptr, scale_ptr, dx_ptr, dscale_part_ptr, n_rows, d, eps, rows_per_program,
                        BLOCK: tl.constexpr):
    # Each program walks a run of rows and keeps its share of dscale in registers, so the
    # partial sums are [programs, d] rather than [rows, d].
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dscale = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        # The last program may run past n_rows: its extra rows load zeros (adding nothing to
        # the partial sums) and store nothing. (One compare rather than `mask & ...`: the
        # interpreter of triton 3.9 returns an int32 mask for bool & bool, then rejects it.)
        row_mask = cols < tl.where(row < n_rows, d, 0)
        offs = row * d + cols
        x = tl.load(x_ptr + offs, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
        normed = x * rstd
        dscale += dy * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        # The gradient reaching the fp32 normalised row is rounded as autograd rounds it in
        # the reference: to the product's dtype, then to x's dtype (the cast back).
        g = (dy * scale).to(dy_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty).to(tl.float32)
        dx = rstd * (g - normed * (tl.sum(g * normed, axis=0) / d))
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
    tl.store(dscale_part_ptr + pid.to(tl.int64) * d + cols, dscale, mask=mask)


@triton.jit
def layer_norm_fwd_kernel(x_ptr, scale_ptr, bias_ptr, y_ptr, d, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / d
    centred = tl.where(mask, x - mean, 0.0)  # padding lanes must not add (0 - mean)**2 to the variance
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / d + eps)
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * d + cols, (centred * rstd * scale + bias).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def layer_norm_bwd_kernel(dy_ptr, x_ptr, scale_ptr, dx_ptr, dscale_part_ptr, dbias_part_ptr, n_rows, d, eps,
                          rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    scale = tl.load(scale_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dscale = tl.zeros([BLOCK], dtype=tl.float32)
    dbias = tl.zeros([BLOCK], dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        # The last program may run past n_rows: its extra rows load zeros (adding nothing to
        # the partial sums) and store nothing. (One compare rather than `mask & ...`: the
        # interpreter of triton 3.9 returns an int32 mask for bool & bool, then rejects it.)
        row_mask = cols < tl.where(row < n_rows, d, 0)
        offs = row * d + cols
        x = tl.load(x_ptr + offs, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=row_mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / d
        centred = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / d + eps)
        xhat = centred * rstd
        dscale += dy * xhat
        dbias += dy
        # d/dx of (x - mean) * rstd: remove the parts of g along 1 and along xhat.
        g = dy * scale
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / d) - tl.sum(g, axis=0) / d)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
    tl.store(dscale_part_ptr + pid.to(tl.int64) * d + cols, dscale, mask=mask)
    tl.store(dbias_part_ptr + pid.to(tl.int64) * d + cols, dbias, mask=mask)
