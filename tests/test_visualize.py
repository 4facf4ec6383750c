"""Sharding pictures: block assignment (pure data), terminal grids, DTensors and the HTML plan page."""

import itertools
import math
import time
from html.parser import HTMLParser

import pytest

from fxmega.config import ParallelConfig
from fxmega.core.errors import ConfigError
from fxmega.models import gpt
from fxmega.parallel.strategy import plan_from
from fxmega.planning.visualize import grid, plan_html, shard_blocks, show, show_param, write_plan_html
from fxmega.sharding.mesh import parse_mesh
from fxmega.sharding.plan import make_plan
from fxmega.sharding.rules import FSDP, Strategy, preset


def specs(**kw):
    return gpt.param_specs(gpt.Config(**{"vocab_size": 256, "max_seq_len": 64, "d_model": 64, "n_layers": 1,
                                         "n_heads": 4, **kw}))


@pytest.fixture(scope="module")
def plan64():
    """64 ranks: pp=2 x dp=8 x tp=4, ZeRO 1 so optimizer state differs from the parameters."""
    return plan_from(specs(n_layers=4), ParallelConfig(mesh="8x4x2", zero=1), gpt.FAMILY)


def check_partition(blocks, shape, mesh, placements):
    """Every rank holds exactly one block, replica sets have the same size, and the blocks
    are all the index combinations the placements imply (they cover the tensor)."""
    ranks = [r for rs in blocks.values() for r in rs]
    assert sorted(ranks) == list(range(mesh.world_size))
    assert len({len(rs) for rs in blocks.values()}) == 1
    splits = [math.prod(n for n, p in zip(mesh.shape, placements) if p == f"S({d})") for d in range(len(shape))]
    assert set(blocks) == set(itertools.product(*(range(s) for s in splits)))


def test_split_dim0_over_tp():
    mesh = parse_mesh("dp=2,tp=4")
    blocks = shard_blocks([768, 3072], mesh, ["R", "S(0)"])
    assert blocks == {(0, 0): [0, 4], (1, 0): [1, 5], (2, 0): [2, 6], (3, 0): [3, 7]}
    check_partition(blocks, [768, 3072], mesh, ["R", "S(0)"])


def test_split_dim1_over_dp():
    mesh = parse_mesh("dp=2,tp=2")
    blocks = shard_blocks([8, 8], mesh, ["S(1)", "R"])
    assert blocks == {(0, 0): [0, 1], (0, 1): [2, 3]}
    check_partition(blocks, [8, 8], mesh, ["S(1)", "R"])


def test_two_axes_on_one_dim_nest_like_data_index():
    """dp is the outer (slower) index, fsdp the inner, as ParamLayout.data_index has it."""
    mesh = parse_mesh("dp=2,fsdp=2,tp=2")
    layout = make_plan(specs(), mesh, Strategy(FSDP, 3, "fsdp + zero 3")).params["blocks.0.mlp.w_in"]  # [embed, mlp]
    placements = layout.placement_names("param", mesh)
    assert placements == ["S(0)", "S(0)", "S(1)"]
    blocks = shard_blocks(layout.shape, mesh, placements)
    check_partition(blocks, layout.shape, mesh, placements)
    for (i, j), ranks in blocks.items():
        for r in ranks:
            c = mesh.coords(r)
            assert i == layout.data_index("param", c) == c["dp"] * 2 + c["fsdp"]
            assert j == c["tp"]
    assert blocks[(1, 0)] == [2] and blocks[(2, 1)] == [5]


def test_replicated_and_scalar():
    mesh = parse_mesh("dp=2,tp=2")
    assert shard_blocks([5, 7], mesh, ["R", "R"]) == {(0, 0): [0, 1, 2, 3]}
    assert shard_blocks([], mesh, ["R", "P"]) == {(): [0, 1, 2, 3]}
    text = grid([], mesh, ["R", "R"], color=False)
    assert "replicated on all 4 ranks" in text


def test_grid_labels_and_no_ansi_without_color():
    mesh = parse_mesh("dp=2,tp=4")
    text = grid([768, 3072], mesh, ["S(0)", "S(1)"], color=False)
    assert "\x1b" not in text
    assert "dp=2:S(0) tp=4:S(1)" in text and "block [384, 768]" in text
    lines = text.splitlines()
    row0 = next(line for line in lines if "dp0 tp0" in line)
    assert [c.strip() for c in row0.strip("│").split("│")] == ["dp0 tp0", "dp0 tp1", "dp0 tp2", "dp0 tp3"]
    ranks1 = [c.strip() for c in lines[lines.index(row0) + 4].strip("│").split("│")]
    assert ranks1 == ["4", "5", "6", "7"]
    assert len({len(line) for line in lines[1:]}) == 1  # a rectangle
    colored = grid([768, 3072], mesh, ["S(0)", "S(1)"])
    assert "\x1b[" in colored and colored.count("\x1b[0m") > 0


def test_grid_compresses_rank_lists_and_picks_dims():
    mesh = parse_mesh("dp=8,tp=4")
    text = grid([768, 12, 64], mesh, ["R", "S(1)"], color=False, axes=("embed", "heads", "head_dim"))
    assert text.splitlines()[0].startswith("[768, 12, 64] (embed, heads, head_dim): dims 0 x 1 shown")
    assert "0,4..28" in text and "3,7..31" in text and "tp3" in text
    one = grid([64], parse_mesh("dp=2,fsdp=2,tp=2"), ["S(0)", "S(0)", "R"], color=False)
    assert "dp1 fsdp0" in one and "4,5" in one and len([ln for ln in one.splitlines() if "│" in ln]) == 4


def test_show_param_on_64_ranks(plan64):
    start = time.perf_counter()
    text = show_param(plan64, "blocks.0.mlp.w_in", color=False)
    opt = show_param(plan64, "embed.tokens", kind="opt", color=False)
    assert time.perf_counter() - start < 0.5
    assert "pp=2:R dp=8:R tp=4:S(1)" in text and "0,4..28" in text and "3,7..31" in text
    assert "logical axes (embed, mlp); local shape [64, 64] per rank; held by pp rank 0 (32 of 64 ranks)" in text
    assert "dp=8:S(1) tp=4:S(0)" in opt and "local shape [64, 8]" in opt and "pp ranks 0,1" in opt
    assert "0,32" in opt and "31,63" in opt  # tied embedding: first and last stage
    last = show_param(plan64, "final_norm.scale", color=False)
    assert "replicated on all 32 ranks" in last and "32..63" in last


def test_bad_path_and_bad_placements(plan64):
    with pytest.raises(ConfigError, match=r"no parameter 'blocks.0.mlp.w_inn'.*blocks.0.mlp.w_in"):
        show_param(plan64, "blocks.0.mlp.w_inn")
    with pytest.raises(ConfigError, match="kind 'moments'"):
        show_param(plan64, "embed.tokens", kind="moments")
    mesh = parse_mesh("dp=2,tp=2")
    with pytest.raises(ConfigError, match=r"1 placements \['S\(0\)'\] for a mesh with 2 axes \(dp, tp\)"):
        shard_blocks([4, 4], mesh, ["S(0)"])
    with pytest.raises(ConfigError, match="splits dim 2, but the tensor has 2 dim"):
        shard_blocks([4, 4], mesh, ["R", "S(2)"])
    with pytest.raises(ConfigError, match="placement 'Shard0' on mesh axis tp"):
        grid([4, 4], mesh, ["R", "Shard0"])


class _Checker(HTMLParser):
    VOID = {"meta", "br", "rect"}

    def __init__(self):
        super().__init__()
        self.stack, self.count = [], {}

    def handle_starttag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.count[tag] = self.count.get(tag, 0) + 1

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack[-3:], tag)
        self.stack.pop()


def parse(page):
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert checker.stack == []
    return checker


def test_plan_html_per_stage(plan64, tmp_path):
    page = plan_html(plan64, title="gpt <tiny> & co")
    checker = parse(page)
    assert "<title>gpt &lt;tiny&gt; &amp; co</title>" in page
    assert page.count('<table class="params"') == len(plan64.pipeline.stages) == 2
    rows = page.count('<tr class="param">')
    assert rows == page.count("<svg") == checker.count["svg"]
    assert rows == sum(len(plan64.pp_owners(p)) for p in plan64.params)  # the tied embedding in both stages
    assert "pp=2 x dp=8 x tp=4 (64 ranks)" in page and "opt: R S(1) S(0)" in page
    assert "<script" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    out = tmp_path / "plan.html"
    write_plan_html(plan64, out)
    assert out.read_text(encoding="utf-8") == plan_html(plan64)
    assert [p.name for p in tmp_path.iterdir()] == ["plan.html"]


def test_plan_html_without_pp():
    plan = make_plan(specs(), parse_mesh("dp=2,tp=2"), preset("zero3"))
    page = plan_html(plan)
    parse(page)
    assert page.count('<table class="params"') == 1
    assert page.count('<tr class="param">') == page.count("<svg") == len(plan.params)


@pytest.fixture
def fake_pg():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_show_dtensor(fake_pg):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = DTensor.from_local(torch.zeros(4, 8), mesh, [Shard(0), Shard(1)], run_check=False)
    text = show(t, color=False)
    assert text.startswith("DTensor [8, 16]  placements dp=2:S(0) tp=2:S(1)  block [4, 8]")
    assert "dp1 tp0" in text and "local shape [4, 8] on rank 0" in text
    assert show(t, color=False) == "\n".join(
        [text.splitlines()[0], grid([8, 16], parse_mesh("dp=2,tp=2"), ["S(0)", "S(1)"], color=False)
         .split("\n", 1)[1], "local shape [4, 8] on rank 0"])
    p = DTensor.from_local(torch.zeros(3, device="meta"), mesh, [Replicate(), Partial()], run_check=False)
    assert "partial on all 4 ranks" in show(p, color=False) and "tp=2:P" in show(p)
