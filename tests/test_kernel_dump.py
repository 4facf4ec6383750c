"""Kernel dumps: the output-code parser on real inductor output, a tiny GPT step dumped on
one device (inductor), and the collectives with their mesh axes on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from fxmega.compiler.kernel_dump import NO_KERNELS, dump_kernels, parse_output_code
from fxmega.config import ParallelConfig, load, override
from fxmega.training.run import Run
from tests.conftest import ROOT
from tests.multirank import run_ranks

# Excerpts of the module inductor (torch 2.13, CPU) generated for the tiny GPT's step with
# provenance tracking on; C++ bodies and long lines cut short.
CPU_SAMPLE = r"""
async_compile = AsyncCompile()


cpp_fused_add_embedding_native_layer_norm_slice_view_3 = async_compile.cpp_pybinding(['float*', 'const int64_t*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(float* in_out_ptr0, const int64_t* in_ptr0)
{
    out(x);
}
''')


cpp_fused__unsafe_view_add_gelu_4 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)
{
}
''')


async_compile.wait(globals())
del async_compile

class Runner:
    def call(self, args):
        arg0_1, arg1_1 = args
        args.clear()
        assert_size_stride(arg11_1, (64, 256), (256, 1), 'input')
        # [Provenance debug handles] cpp_fused_add_embedding_native_layer_norm_slice_view_3:7
        cpp_fused_add_embedding_native_layer_norm_slice_view_3(buf12, arg1_1, arg0_1, arg2_1, buf9, arg8_1)
        buf15 = empty_strided_cpu((32, 256), (256, 1), torch.float32)
        # Topologically Sorted Source Nodes: [h_1, y_2], Original ATen: [aten.native_layer_norm, aten.view, aten.mm]
        # [Provenance debug handles] extern_kernels.mm:8
        extern_kernels.mm(reinterpret_tensor(buf14, (32, 64), (64, 1), 0), arg11_1, out=buf15)
        assert_size_stride(arg12_1, (256, ), (1, ), 'input')
        # [Provenance debug handles] cpp_fused__unsafe_view_add_gelu_4:9
        cpp_fused__unsafe_view_add_gelu_4(buf15, arg12_1, buf16)
        buf17 = buf9; del buf9  # reuse
        aten.scatter_reduce_.two(buf27,-1,reinterpret_tensor(arg17_1, (2, 16, 1), (17, 1, 1), 0), reduce='sum')
        # Topologically Sorted Source Nodes: [grad, _foreach_norm], Original ATen: [aten.sum, aten._foreach_norm]
        # [Provenance debug handles] torch.ops.aten._foreach_norm.Scalar:37
        buf76 = torch.ops.aten._foreach_norm.Scalar([buf60, buf75, buf61, buf62])
        assert_size_stride(buf77, (), (), 'torch.ops.aten._foreach_norm.Scalar')
        # Topologically Sorted Source Nodes: [all_reduce], Original ATen: [_c10d_functional.all_reduce]
        torch.ops._c10d_functional.all_reduce_.default(buf3, 'sum', '1')
        # Topologically Sorted Source Nodes: [wait_tensor], Original ATen: [_c10d_functional.wait_tensor]
        torch.ops._c10d_functional.wait_tensor.default(buf3)
        return (buf3, )


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = rand_strided((256, 64), (64, 1), device='cpu', dtype=torch.float32)
"""

# The shape of inductor's Triton output (codegen/wrapper.py and codegen/triton.py of 2.13).
TRITON_SAMPLE = r"""
# kernel path: /tmp/torchinductor/ab/cabc.py
# Topologically Sorted Source Nodes: [x, h], Original ATen: [aten.add, aten.native_layer_norm]
# Source node to ATen node mapping:
#   h => add_1, var_mean
triton_per_fused_add_native_layer_norm_0 = async_compile.triton('triton_per_fused_add_native_layer_norm_0', '''
import triton
@triton.jit
def triton_per_fused_add_native_layer_norm_0(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (x0), xmask)
''', device_str='cuda')

def call(args):
    with torch.cuda._DeviceGuard(0):
        stream0 = get_raw_stream(0)
        # Topologically Sorted Source Nodes: [x, h], Original ATen: [aten.add, aten.native_layer_norm]
        # [Provenance debug handles] triton_per_fused_add_native_layer_norm_0:1
        triton_per_fused_add_native_layer_norm_0.run(arg0_1, buf0, 32, 64, stream=stream0)
        buf1 = empty_strided_cuda((32, 192), (192, 1), torch.float32)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
"""


def test_parse_output_code_on_cpu_sample():
    kernels = parse_output_code(CPU_SAMPLE)
    assert [(k.name, k.kind) for k in kernels] == [
        ("cpp_fused_add_embedding_native_layer_norm_slice_view_3", "cpp"),
        ("extern_kernels.mm", "extern"),
        ("cpp_fused__unsafe_view_add_gelu_4", "cpp"),
        ("torch.ops.aten.scatter_reduce_.two", "aten"),
        ("torch.ops.aten._foreach_norm.Scalar", "aten"),
        ("torch.ops._c10d_functional.all_reduce_.default", "collective"),
        ("torch.ops._c10d_functional.wait_tensor.default", "wait"),
    ]
    cpp, mm, _, scatter, norm, reduce, _ = kernels
    assert cpp.handle == "cpp_fused_add_embedding_native_layer_norm_slice_view_3:7" and cpp.aten == []
    assert mm.handle == "extern_kernels.mm:8"
    assert mm.source_nodes == ["h_1", "y_2"] and mm.aten == ["aten.native_layer_norm", "aten.view", "aten.mm"]
    assert scatter.handle is None and scatter.aten == []  # the mm's comment is not carried over
    assert norm.handle == "torch.ops.aten._foreach_norm.Scalar:37" and norm.aten[-1] == "aten._foreach_norm"
    assert reduce.aten == ["_c10d_functional.all_reduce"] and reduce.group == "1"


def test_parse_output_code_on_triton_shape():
    kernels = parse_output_code(TRITON_SAMPLE)
    assert [(k.name, k.kind) for k in kernels] == [("triton_per_fused_add_native_layer_norm_0", "triton"),
                                                   ("extern_kernels.mm", "extern")]
    assert kernels[0].aten == ["aten.add", "aten.native_layer_norm"] and kernels[1].aten == []


def tiny(extra: tuple = (), parallel: dict | None = None):
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["train.device=cpu", "train.seq_len=16", "model.n_layers=1", "model.vocab_size=255", *extra])
    if parallel is not None:
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(**parallel))
    return cfg


@pytest.mark.slow
def test_one_device_inductor_dump(tmp_path):
    run = Run(tiny(("train.global_batch_size=2", "train.micro_batch_size=2")))
    with dump_kernels(tmp_path) as dumps:
        run.do_step()
    assert len(dumps) == 1
    rank = tmp_path / "rank0"
    for name in ("index.json", "index.md", "graph0/fx_graph.py", "graph0/output_code.py"):
        assert (rank / name).is_file(), name
    assert "rank0/index.md" in (tmp_path / "index.md").read_text()
    (graph,) = json.loads((rank / "index.json").read_text())["graphs"]
    assert graph["backend"] == "inductor" and graph["kind"].startswith("joint") and graph["fx_nodes"] > 100
    kernels = graph["kernels"]
    fused = [k for k in kernels if k["kind"] == "cpp"]
    assert fused and all(k["fuses"] for k in fused)
    assert any("aten.var_mean" in k["fuses"] or "aten.native_layer_norm" in k["fuses"] for k in fused)
    assert any(k["name"] == "extern_kernels.mm" and k["fuses"] == ["aten.mm"] for k in kernels)
    code = (rank / "graph0/output_code.py").read_text()
    assert all(f"{k['name']}(" in code or f"{k['name']}.run(" in code for k in fused)
    assert graph["collectives"] == [] and graph["code_collectives"] == 0
    md = (rank / "index.md").read_text()
    assert "| fused C++ |" in md and "`extern_kernels.mm`" in md


def worker(directory: str) -> list:
    """tp=2 compiled by inductor, then dp=2 by aot_eager, each dumped; returns the indexes."""
    from fxmega.parallel import distributed
    from fxmega.sharding.mesh import MeshSpec

    out = []
    for name, extra, parallel in (
            ("tp2", ("train.global_batch_size=4", "train.micro_batch_size=4"), dict(mesh="tp=2")),
            ("dp2", ("train.global_batch_size=4", "train.micro_batch_size=2", "train.compile_backend=aot_eager"),
             dict(mesh="dp=2"))):
        cfg = tiny(extra, parallel)
        par, device = distributed.setup(cfg, MeshSpec.parse(cfg.parallel.mesh))
        run = Run(cfg, par, device)
        torch._dynamo.reset()
        with dump_kernels(Path(directory) / name, rank=par.rank, group_labels=par.groups.labels):
            run.do_step()
        out.append(json.loads((Path(directory) / name / f"rank{par.rank}" / "index.json").read_text()))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dumps")
    return directory, run_ranks(2, "tests.test_kernel_dump:worker", str(directory))


@pytest.mark.slow
def test_tensor_parallel_collectives_on_tp_axis(two_ranks):
    directory, results = two_ranks
    for rank, (tp, _) in enumerate(results):
        assert tp["rank"] == rank
        (graph,) = tp["graphs"]
        assert graph["backend"] == "inductor"
        axes = {(c["op"], c["axis"]) for c in graph["collectives"]}
        assert ("all_reduce_", "tp") in axes, axes  # post-grad passes made most of them in place
        assert {c["axis"] for c in graph["collectives"]} <= {"tp", "world", "dp"}
        # the output code calls the FX graph's collectives in the same order, on the same groups
        calls = [k for k in graph["kernels"] if k["kind"] == "collective"]
        assert len(calls) == graph["code_collectives"] == len(graph["collectives"])
        assert [(k["name"].split(".")[3].rstrip("_"), k["axis"]) for k in calls] == \
            [(c["op"].rstrip("_"), c["axis"]) for c in graph["collectives"]]
        # what each call can hide behind in inductor's final order, one entry per call of the code
        assert [op.rstrip("_") for op, _ in graph["code_hidden"]] == [c["op"].rstrip("_") for c in graph["collectives"]]
        assert all("gflop_before_wait" in c and "ops_before_wait" in c for c in graph["collectives"])
        index = (directory / "tp2" / f"rank{rank}" / "index.md").read_text()
        assert "| all_reduce |" in index and "kernels before its wait" in index
    assert "rank1/index.md" in (directory / "tp2" / "index.md").read_text()


@pytest.mark.slow
def test_data_parallel_gradients_all_reduced_on_dp_axis_aot_eager(two_ranks):
    directory, results = two_ranks
    for _, dp in results:
        (graph,) = dp["graphs"]
        assert graph["backend"] == "aot_eager" and graph["note"] == NO_KERNELS and graph["kernels"] == []
        assert "output_code" not in graph["files"]
        big = [c for c in graph["collectives"] if c["shape"]]
        assert big and all(c["op"] == "all_reduce" and c["axis"] == "dp" for c in big)
