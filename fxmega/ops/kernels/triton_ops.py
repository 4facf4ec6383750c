"""Hand-written Triton kernels as torch custom ops: RMSNorm, LayerNorm, per-row cross-entropy.

Why custom ops: a raw Triton launch on CPU tensors cannot go through inductor (it has no
Triton backend for CPU), and opaque ops keep the hand-written kernels as written. Wrapped as
``torch.library.custom_op`` with a fake (shape/dtype) implementation, each kernel is one
opaque node of the compiled graph; ``register_autograd`` gives the norms a backward that
is itself a custom op, so a compiled step that calls ``torch.autograd.grad`` keeps both.

Ops (namespace ``fxmega``): ``rms_norm_fwd``, ``rms_norm_bwd``, ``layer_norm_fwd``,
``layer_norm_bwd``, ``cross_entropy_rows``.

The kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when
``TRITON_INTERPRET=1`` was set before this module was imported (``triton.jit`` decides at
decoration time which one it builds). Note that the interpreter rounds fp32 -> bf16 by
truncation, where a GPU rounds to nearest even: bf16 results there differ by up to one ulp.

This module imports without triton; ``AVAILABLE`` says whether the kernels can run.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

try:
    import triton

    from fxmega.ops.kernels import triton_cross_entropy as _ce_kernels
    from fxmega.ops.kernels import triton_norms as _norm_kernels
except ImportError as exc:  # the `triton` extra is not installed
    AVAILABLE = False
    _IMPORT_ERROR: str = str(exc)
    INTERPRETED = False
else:
    AVAILABLE = True
    _IMPORT_ERROR = ""
    # What matters is what triton.jit built, which it decided from the environment at import.
    INTERPRETED = type(_norm_kernels.rms_norm_fwd_kernel).__name__ == "InterpretedFunction"

__all__ = ["AVAILABLE", "INTERPRETED", "cross_entropy_rows", "layer_norm", "rms_norm"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_NORM_DIM = 65536  # one row per program, held in registers: beyond this it would spill
CE_BLOCK = 4096  # vocabulary columns per step of the cross-entropy loop
_INTERPRETER_PROGRAMS = 4  # backward programs in the interpreter: few, so tests walk several rows per program


def _require_triton() -> None:
    if not AVAILABLE:
        raise RuntimeError(
            "fxmega's Triton kernels need the `triton` package: `pip install triton` "
            f"(or `pip install fxmega[triton]`). Import failed with: {_IMPORT_ERROR}"
        )


def _check_device(t: Tensor) -> None:
    _require_triton()
    if t.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            "Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to run them in Triton's "
            f"interpreter for tests); got a tensor on {t.device}. Set TRITON_INTERPRET=1 before "
            "fxmega.ops.kernels.triton_ops is imported."
        )


@contextlib.contextmanager
def _on_device(t: Tensor) -> Iterator[None]:
    """Triton launches on the current CUDA device: make it the tensor's one."""
    if t.device.type == "cuda":
        with torch.cuda.device(t.device):
            yield
    else:
        yield


def _num_warps(block: int) -> int:
    # More warps for wider rows, so each thread holds a handful of elements, not hundreds.
    return 4 if block < 2048 else 8 if block < 8192 else 16


def _backward_programs(t: Tensor, n_rows: int) -> int:
    """How many programs share the rows in a norm backward: enough to fill the GPU, few
    enough that the per-program partial sums of dscale/dbias stay small. At least one, so
    that an input with no rows still gets (zero) partial sums written."""
    if t.device.type == "cuda":
        limit = 4 * torch.cuda.get_device_properties(t.device).multi_processor_count
    else:
        limit = _INTERPRETER_PROGRAMS
    return max(1, min(n_rows, limit))


def _check_norm_args(x: Tensor, *params: Tensor) -> None:
    # Called by the fake implementations too, so a bad call fails while compiling.
    d = x.shape[-1]
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"norm kernels take float32/bfloat16/float16 input, got {x.dtype}")
    if d > MAX_NORM_DIM:
        raise ValueError(f"norm kernels hold a row in registers: last dim {d} > {MAX_NORM_DIM}")
    for p in params:
        if p.shape != (d,):
            raise ValueError(f"norm parameter of shape {tuple(p.shape)} does not match the last dim {d} of x")
        if p.device != x.device:  # a kernel would read a host pointer as a device one
            raise ValueError(f"norm parameter on {p.device}, input on {x.device}")


def _rows(t: Tensor) -> Tensor:
    """``[..., d] -> [rows, d]`` contiguous: the kernels index ``row * d + col`` (and an
    incoming gradient may be an expanded, stride-0 tensor)."""
    return t.reshape(-1, t.shape[-1]).contiguous()


# ---------------------------------------------------------------- RMSNorm


@torch.library.custom_op("fxmega::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    _check_norm_args(x, scale)
    _check_device(x)
    x2, d = _rows(x), x.shape[-1]
    y = torch.empty(x2.shape, dtype=torch.promote_types(scale.dtype, x.dtype), device=x.device)
    block = triton.next_power_of_2(d)
    with _on_device(x):
        if x2.shape[0]:  # an empty grid is not a launch CUDA accepts
            _norm_kernels.rms_norm_fwd_kernel[(x2.shape[0],)](
                x2, scale.contiguous(), y, d, eps, BLOCK=block, num_warps=_num_warps(block))
    return y.view(x.shape)


@_rms_norm_fwd.register_fake
def _(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    _check_norm_args(x, scale)
    return torch.empty(x.shape, dtype=torch.promote_types(scale.dtype, x.dtype), device=x.device)


def _backward_launch(x: Tensor, dy: Tensor) -> tuple[Tensor, Tensor, int, int, int, int]:
    """Rows of x and dy, d, the row count, and how many programs walk how many rows each."""
    x2, dy2, d = _rows(x), _rows(dy), x.shape[-1]
    n_rows = x2.shape[0]
    programs = _backward_programs(x, n_rows)
    rows_per_program = max(1, triton.cdiv(n_rows, programs))
    programs = max(1, triton.cdiv(n_rows, rows_per_program))  # no program left without rows
    return x2, dy2, d, n_rows, programs, rows_per_program


@torch.library.custom_op("fxmega::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: Tensor, x: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_norm_args(x, scale)
    _check_device(x)
    x2, dy2, d, n_rows, programs, rows_per_program = _backward_launch(x, dy)
    dx = torch.empty_like(x2)
    dscale_part = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(d)
    with _on_device(x):
        _norm_kernels.rms_norm_bwd_kernel[(programs,)](
            dy2, x2, scale.contiguous(), dx, dscale_part, n_rows, d, eps, rows_per_program,
            BLOCK=block, num_warps=_num_warps(block))
    return dx.view(x.shape), dscale_part.sum(0).to(scale.dtype)


@_rms_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, scale: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_norm_args(x, scale)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(scale)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, scale, eps = inputs
    ctx.save_for_backward(x, scale)
    ctx.eps = eps


def _rms_norm_backward(ctx, dy: Tensor):
    x, scale = ctx.saved_tensors
    dx, dscale = torch.ops.fxmega.rms_norm_bwd(dy, x, scale, ctx.eps)
    return dx, dscale, None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


# ---------------------------------------------------------------- LayerNorm


@torch.library.custom_op("fxmega::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: Tensor, scale: Tensor, bias: Tensor, eps: float) -> Tensor:
    _check_norm_args(x, scale, bias)
    _check_device(x)
    x2, d = _rows(x), x.shape[-1]
    y = torch.empty_like(x2)  # F.layer_norm returns x's dtype whatever the parameters' dtype
    block = triton.next_power_of_2(d)
    with _on_device(x):
        if x2.shape[0]:  # an empty grid is not a launch CUDA accepts
            _norm_kernels.layer_norm_fwd_kernel[(x2.shape[0],)](
                x2, scale.contiguous(), bias.contiguous(), y, d, eps, BLOCK=block, num_warps=_num_warps(block))
    return y.view(x.shape)


@_layer_norm_fwd.register_fake
def _(x: Tensor, scale: Tensor, bias: Tensor, eps: float) -> Tensor:
    _check_norm_args(x, scale, bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fxmega::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(dy: Tensor, x: Tensor, scale: Tensor, bias: Tensor,
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    # bias only gives dbias its dtype: the backward does not read it.
    _check_norm_args(x, scale, bias)
    _check_device(x)
    x2, dy2, d, n_rows, programs, rows_per_program = _backward_launch(x, dy)
    dx = torch.empty_like(x2)
    dscale_part = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    dbias_part = torch.empty_like(dscale_part)
    block = triton.next_power_of_2(d)
    with _on_device(x):
        _norm_kernels.layer_norm_bwd_kernel[(programs,)](
            dy2, x2, scale.contiguous(), dx, dscale_part, dbias_part, n_rows, d, eps, rows_per_program,
            BLOCK=block, num_warps=_num_warps(block))
    return dx.view(x.shape), dscale_part.sum(0).to(scale.dtype), dbias_part.sum(0).to(bias.dtype)


@_layer_norm_bwd.register_fake
def _(dy: Tensor, x: Tensor, scale: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_norm_args(x, scale, bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(scale), torch.empty_like(bias)


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, scale, bias, eps = inputs
    ctx.save_for_backward(x, scale, bias)
    ctx.eps = eps


def _layer_norm_backward(ctx, dy: Tensor):
    x, scale, bias = ctx.saved_tensors
    dx, dscale, dbias = torch.ops.fxmega.layer_norm_bwd(dy, x, scale, bias, ctx.eps)
    return dx, dscale, dbias, None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


# ---------------------------------------------------------------- cross-entropy rows


def _check_ce_args(logits: Tensor, targets: Tensor, vocab_size: int, block_size: int) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_rows takes logits [N, V] and targets [N], got "
                         f"{tuple(logits.shape)} and {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"targets on {targets.device}, logits on {logits.device}")
    if logits.dtype not in _FLOAT_DTYPES or targets.dtype != torch.int64:
        raise TypeError(f"cross_entropy_rows takes float logits and int64 targets, got {logits.dtype}, {targets.dtype}")
    if not 0 < vocab_size <= logits.shape[1]:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {logits.shape[1]}] (the logits' last dim)")
    if block_size and (block_size < 16 or block_size & (block_size - 1)):
        raise ValueError(f"block_size {block_size} must be a power of two >= 16 (or 0: automatic)")


@torch.library.custom_op("fxmega::cross_entropy_rows", mutates_args=())
def _cross_entropy_rows(logits: Tensor, targets: Tensor, vocab_size: int, block_size: int) -> tuple[Tensor, Tensor]:
    _check_ce_args(logits, targets, vocab_size, block_size)
    _check_device(logits)
    logits = logits.contiguous()
    loss = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    dlogits = torch.empty_like(logits)
    block_size = block_size or min(CE_BLOCK, max(16, triton.next_power_of_2(logits.shape[1])))
    with _on_device(logits):
        if logits.shape[0]:
            _ce_kernels.cross_entropy_rows_kernel[(logits.shape[0],)](
                logits, targets.contiguous(), loss, dlogits, logits.shape[1], vocab_size,
                BLOCK=block_size, num_warps=_num_warps(block_size))
    return loss, dlogits


@_cross_entropy_rows.register_fake
def _(logits: Tensor, targets: Tensor, vocab_size: int, block_size: int) -> tuple[Tensor, Tensor]:
    _check_ce_args(logits, targets, vocab_size, block_size)
    return (torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device),
            torch.empty(logits.shape, dtype=logits.dtype, device=logits.device))


# ---------------------------------------------------------------- public API


def rms_norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm over the last dim, exactly :func:`fxmega.ops.layers.rms_norm`: normalise
    in fp32, cast back to ``x.dtype``, then multiply by ``scale`` (Hugging Face's order, which
    changes bf16 results). ``x [..., d]``, ``scale [d]``; the result has dtype
    ``promote(scale.dtype, x.dtype)``. Differentiable in ``x`` and ``scale``: one kernel each
    way instead of the reference's chain of elementwise ops and reductions."""
    _require_triton()
    return torch.ops.fxmega.rms_norm_fwd(x, scale, eps)


def layer_norm(x: Tensor, scale: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``F.layer_norm(x, (d,), scale, bias, eps)``: statistics in fp32, result in
    ``x.dtype``. Differentiable in ``x``, ``scale`` and ``bias``."""
    _require_triton()
    return torch.ops.fxmega.layer_norm_fwd(x, scale, bias, eps)


def cross_entropy_rows(logits: Tensor, targets: Tensor, vocab_size: int,
                       *, block_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-row cross-entropy and its derivative w.r.t. the row, in one pass over the logits.

    ``logits [N, V]`` (fp32, bf16 or fp16), ``targets [N]`` int64 in ``[0, vocab_size)``.
    Returns ``loss [N]`` fp32 ``= logsumexp(row[:vocab_size]) - row[target]`` and
    ``dlogits [N, V]`` in ``logits.dtype`` ``= softmax(row[:vocab_size]) - onehot(target)``,
    with 0 in the padding columns ``>= vocab_size``.

    Not an autograd function on purpose: a chunked loss computes a chunk's logits, calls this,
    and applies ``dlogits`` to the hidden states and the unembedding itself, so the full
    ``[tokens, V]`` logits never exist at once. Only the loss of a row is defined for a valid
    target; mask rows (e.g. ignored positions) in the caller. ``block_size`` (a power of two)
    is the number of vocabulary columns per step; by default ``min(4096, next_pow2(V))``.
    """
    _require_triton()
    return torch.ops.fxmega.cross_entropy_rows(logits, targets, vocab_size, block_size or 0)
