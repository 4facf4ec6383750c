"""Triton kernels (fxmega.ops.kernels.triton_ops) against their torch references, on CPU through
Triton's interpreter.

Why every check runs in a child process: ``triton.jit`` chooses between a GPU kernel and an
interpreted one when the kernel module is imported, from ``TRITON_INTERPRET``. Setting it in
this pytest process would be too late if any earlier test had imported the module, and would
leak into every later test. A child started with ``TRITON_INTERPRET=1`` is right whatever
ran before, and one started without it shows the error a CPU user gets. The child runs this
same file (``python tests/test_kernels.py <check>``), so each check is plain code below.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the child runs this file as a script
from tests.tolerance import assert_within_rounding, reduction_rtol, run_rtol  # noqa: E402

# (atol, rtol). fp32: the norms reduce over d <= 100 twice in their backward (the statistic,
# then the dot with dy), each in another order than torch's, so 2 x 100 x eps. bf16 is
# looser: the interpreter rounds fp32 -> bf16 by truncation where torch rounds to nearest,
# so results can differ by one bf16 ulp (2**-7 relative) plus the fp32 bound.
TOLERANCE = {torch.float32: (reduction_rtol(2 * 100), reduction_rtol(2 * 100)), torch.bfloat16: (3e-2, 2e-2)}
SHAPES = [(2, 3, 48), (2, 3, 100), (7, 100)]  # 7 rows: the backward's last program has a ragged tail


def _run(check: str, interpret: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, __file__, check], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"check {check!r} failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.slow
def test_rms_norm_matches_reference():
    _run("rms_norm")


@pytest.mark.slow
def test_layer_norm_matches_reference():
    _run("layer_norm")


@pytest.mark.slow
def test_cross_entropy_rows_matches_reference():
    _run("cross_entropy_rows")


@pytest.mark.slow
def test_opcheck():
    _run("opcheck")


@pytest.mark.slow
def test_compiled_autograd_grad_keeps_custom_ops():
    _run("compile")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_gpt", pytest.param("tiny_llama", marks=pytest.mark.e2e)])  # llama: make e2e
def test_compiled_step_with_triton_kernels_equals_reference(model):
    _run(f"step_{model}")


@pytest.mark.slow
def test_run_refuses_triton_kernels_on_cpu_without_interpreter():
    proc = _run("run_refuses", interpret=False)
    assert "raised as expected" in proc.stdout


@pytest.mark.slow
def test_cpu_without_interpreter_is_a_clear_error():
    proc = _run("no_interpreter", interpret=False)
    assert "raised as expected" in proc.stdout


@pytest.mark.slow
def test_imports_without_triton():
    proc = _run("without_triton", interpret=False)
    assert "raised as expected" in proc.stdout


# ---------------------------------------------------------------- checks (run in the child)


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rounded_to=None) -> None:
    """``rounded_to``: the dtype of the least precise intermediate, if not the result's."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    atol, rtol = TOLERANCE[rounded_to or expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def _inputs(shape, dtype, with_bias=False):
    torch.manual_seed(0)
    d = shape[-1]
    x = torch.randn(shape).to(dtype).requires_grad_()
    scale = (1 + 0.1 * torch.randn(d)).to(dtype).requires_grad_()
    bias = (0.1 * torch.randn(d)).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    return (x, scale, bias, dy) if with_bias else (x, scale, dy)


def check_rms_norm():
    from fxmega.ops.kernels import triton_ops
    from fxmega.ops.layers import rms_norm

    for dtype in TOLERANCE:
        for shape in SHAPES:
            x, scale, dy = _inputs(shape, dtype)
            y = triton_ops.rms_norm(x, scale, 1e-6)
            y_ref = rms_norm(x, scale, 1e-6)
            _close(y, y_ref, f"rms_norm y {dtype} {shape}")
            grads = torch.autograd.grad(y, (x, scale), dy)
            grads_ref = torch.autograd.grad(y_ref, (x, scale), dy)
            for name, g, g_ref in zip(("dx", "dscale"), grads, grads_ref):
                _close(g, g_ref, f"rms_norm {name} {dtype} {shape}")
    # No rows: nothing to launch, and zero parameter gradients.
    x, scale, dy = _inputs((0, 48), torch.float32)
    y = triton_ops.rms_norm(x, scale, 1e-6)
    assert y.shape == (0, 48) and torch.all(torch.autograd.grad(y, scale, dy[:0])[0] == 0)
    # Mixed dtypes follow the reference's promotion: bf16 x with an fp32 scale gives fp32
    # (the normalised row is still rounded to bf16 on the way).
    x, scale, _ = _inputs((2, 3, 48), torch.bfloat16)
    scale32 = scale.detach().float()
    _close(triton_ops.rms_norm(x, scale32, 1e-6), rms_norm(x, scale32, 1e-6), "rms_norm mixed", torch.bfloat16)


def check_layer_norm():
    from fxmega.ops.kernels import triton_ops

    for dtype in TOLERANCE:
        for shape in SHAPES:
            x, scale, bias, dy = _inputs(shape, dtype, with_bias=True)
            y = triton_ops.layer_norm(x, scale, bias, 1e-5)
            y_ref = F.layer_norm(x, (shape[-1],), scale, bias, 1e-5)
            _close(y, y_ref, f"layer_norm y {dtype} {shape}")
            grads = torch.autograd.grad(y, (x, scale, bias), dy)
            grads_ref = torch.autograd.grad(y_ref, (x, scale, bias), dy)
            for name, g, g_ref in zip(("dx", "dscale", "dbias"), grads, grads_ref):
                _close(g, g_ref, f"layer_norm {name} {dtype} {shape}")


def _cross_entropy_reference(logits, targets, vocab_size):
    padded = torch.arange(logits.shape[1]) >= vocab_size
    masked = logits.float().masked_fill(padded, float("-inf"))
    loss = torch.logsumexp(masked, -1) - masked.gather(1, targets[:, None])[:, 0]
    dlogits = masked.softmax(-1) - F.one_hot(targets, logits.shape[1])
    return loss, dlogits.to(logits.dtype)


def check_cross_entropy_rows():
    from fxmega.ops.kernels import triton_ops

    torch.manual_seed(0)
    n, v, vocab_size = 5, 300, 250  # V is not a multiple of any block; columns 250.. are padding
    for dtype in TOLERANCE:
        logits = (4 * torch.randn(n, v)).to(dtype)
        targets = torch.randint(0, vocab_size, (n,))
        targets[0] = vocab_size - 1  # the last real column, in a block that also holds padding
        loss_ref, dlogits_ref = _cross_entropy_reference(logits, targets, vocab_size)
        # 64: five blocks, the last all padding (the online softmax across blocks);
        # default: one block of 512 for this V.
        for block_size in (64, None):
            loss, dlogits = triton_ops.cross_entropy_rows(logits, targets, vocab_size, block_size=block_size)
            assert loss.dtype == torch.float32 and loss.shape == (n,)
            # the loss, lse - z_t: a log-sum-exp over v columns (online, by blocks) in another order
            # than torch's, whose sum of positive terms is within v eps relative, so within v eps
            # absolute after the log; z_t adds eps x |z|
            torch.testing.assert_close(loss, loss_ref, rtol=0, atol=reduction_rtol(v) * float(logits.abs().max()))
            _close(dlogits, dlogits_ref, f"dlogits {dtype} block {block_size}")
            assert torch.all(dlogits[:, vocab_size:] == 0)
    # A large vocabulary with the default block of 4096 walks several blocks too.
    logits = 4 * torch.randn(2, 50_000)
    targets = torch.tensor([0, 49_999])
    loss, dlogits = triton_ops.cross_entropy_rows(logits, targets, 50_000)
    loss_ref, dlogits_ref = _cross_entropy_reference(logits, targets, 50_000)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=reduction_rtol(50_000) * float(logits.abs().max()))
    _close(dlogits, dlogits_ref, "dlogits V=50000")


def check_opcheck():
    from fxmega.ops.kernels import triton_ops  # noqa: F401  (registers the ops)

    ops = torch.ops.fxmega
    for dtype in TOLERANCE:
        x, scale, bias, dy = _inputs((2, 3, 48), dtype, with_bias=True)
        plain = [t.detach() for t in (x, scale, bias, dy)]
        torch.library.opcheck(ops.rms_norm_fwd, (x, scale, 1e-6))
        torch.library.opcheck(ops.rms_norm_bwd, (plain[3], plain[0], plain[1], 1e-6))
        torch.library.opcheck(ops.layer_norm_fwd, (x, scale, bias, 1e-5))
        torch.library.opcheck(ops.layer_norm_bwd, (plain[3], plain[0], plain[1], plain[2], 1e-5))
        logits = torch.randn(4, 100).to(dtype)
        torch.library.opcheck(ops.cross_entropy_rows, (logits, torch.tensor([0, 5, 89, 3]), 90, 32))


def check_compile():
    from torch._inductor.utils import run_and_get_code

    from fxmega.ops.kernels import triton_ops
    from fxmega.ops.layers import rms_norm

    torch._dynamo.config.trace_autograd_ops = True  # as fxmega.training.step.enable_autograd_in_compile

    def step(norm, x, scale, w):
        # A train-step shape: loss, then autograd.grad on the leaves inside the compiled region.
        loss = (norm(x, scale, 1e-6) @ w).square().sum()
        grads = torch.autograd.grad(loss, (x, scale, w))
        return [loss.detach(), *grads]

    torch.manual_seed(0)
    x = torch.randn(2, 3, 48, requires_grad=True)
    scale = (1 + 0.1 * torch.randn(48)).requires_grad_()
    w = torch.randn(48, 16, requires_grad=True)
    expected = step(rms_norm, x, scale, w)
    compiled = torch.compile(lambda *a: step(triton_ops.rms_norm, *a), fullgraph=True, dynamic=False)
    got, code = run_and_get_code(compiled, x, scale, w)
    for name, g, e in zip(("loss", "dx", "dscale", "dw"), got, expected):
        # the norm over 48, the matmul over 48, the loss over 96 outputs; each in its own order
        assert_within_rounding(g, e, (48, 48, 96), what=name)
    source = "\n".join(code)
    # Both kernels stay opaque calls in inductor's output; nothing was traced through them.
    assert "fxmega.rms_norm_fwd" in source and "fxmega.rms_norm_bwd" in source, source[-3000:]


def check_no_interpreter():
    from fxmega.ops.kernels import triton_ops

    assert not triton_ops.INTERPRETED
    x = torch.randn(2, 8)
    try:
        triton_ops.rms_norm(x, torch.ones(8), 1e-6)
    except RuntimeError as exc:
        assert "Triton kernels need a CUDA device (or TRITON_INTERPRET=1" in str(exc), str(exc)
    else:
        raise AssertionError("rms_norm on a CPU tensor without the interpreter did not raise")
    print("raised as expected")


def check_without_triton():
    sys.modules["triton"] = None  # makes `import triton` raise ImportError, as if not installed
    from fxmega.ops.kernels import triton_ops

    assert not triton_ops.AVAILABLE
    try:
        triton_ops.layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8), 1e-5)
    except RuntimeError as exc:
        assert "pip install triton" in str(exc), str(exc)
    else:
        raise AssertionError("layer_norm without triton did not raise")
    print("raised as expected")


def _train(model: str, kernels: str) -> tuple[list[float], list[float], object]:
    from fxmega.config import load, override
    from fxmega.training.run import Run

    torch._dynamo.reset()
    # the chunked loss runs the cross-entropy kernel; LayerNorm (GPT) or RMSNorm (Llama) the norms
    cfg = override(load(ROOT / "configs" / f"{model}.py"),
                   ["train.device=cpu", "train.compile=true", "train.compile_backend=aot_eager",
                    "compute.loss_chunk=96", f"compute.kernels={kernels}"])
    run = Run(cfg)
    metrics = [run.do_step() for _ in range(3)]
    return [m["loss"] for m in metrics], [m["grad_norm"] for m in metrics], cfg


def _check_step(model: str) -> None:
    """Losses and gradient norms per step equal the reference kernels' up to rounding. The
    parameters after AdamW are not compared: AdamW turns a rounding-level difference in a
    near-zero gradient into a step of up to lr, so they bound nothing (the kernels'
    gradients are compared element by element in the checks above)."""
    ref_losses, ref_norms, cfg = _train(model, "reference")
    losses, norms, _ = _train(model, "triton")
    for step, (a, b, na, nb) in enumerate(zip(losses, ref_losses, norms, ref_norms), 1):
        rtol = run_rtol(cfg, step)  # the kernels sum in another order than torch's ops
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b} (rtol {rtol:.3g})"
        assert abs(na - nb) <= rtol * abs(nb), f"step {step}: grad norm {na} vs reference {nb} (rtol {rtol:.3g})"


def check_step_tiny_gpt():
    _check_step("tiny_gpt")


def check_step_tiny_llama():
    _check_step("tiny_llama")


def check_run_refuses():
    from fxmega.config import load, override
    from fxmega.core.errors import ConfigError
    from fxmega.training.run import Run

    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"), ["train.device=cpu", "compute.kernels=triton"])
    try:
        Run(cfg)
    except ConfigError as exc:
        assert "compute.kernels=triton runs on CUDA devices" in str(exc), str(exc)
    else:
        raise AssertionError("a CPU run with compute.kernels=triton did not raise")
    print("raised as expected")


if __name__ == "__main__":
    globals()["check_" + sys.argv[1]]()
