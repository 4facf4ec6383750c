"""Meshes, rules and plans: pure data, no process group. Every rejected input is a
ConfigError naming what is wrong and the fix."""

import pytest

from fxmega.config import ParallelConfig
from fxmega.core.errors import ConfigError
from fxmega.models import gpt, llama, mixtral
from fxmega.ops.moe import MoE
from fxmega.parallel.strategy import strategy_from
from fxmega.sharding.mesh import MeshSpec, check_world_size, parse_mesh
from fxmega.sharding.plan import make_plan
from fxmega.sharding.rules import MEGATRON, Strategy, preset


def tiny(**kw):
    return gpt.param_specs(gpt.Config(**{"vocab_size": 256, "max_seq_len": 64, "d_model": 64, "n_layers": 1,
                                         "n_heads": 4, **kw}))


def test_mesh_sizes_in_order_and_by_name():
    assert parse_mesh("8x4x2") == MeshSpec.of(dp=8, tp=4, pp=2)
    assert parse_mesh("dp=2,tp=2") == parse_mesh("2x2") == parse_mesh("tp=2,dp=2")
    assert parse_mesh("1").world_size == 1
    assert parse_mesh("fsdp=4,dp=2").names == ("dp", "fsdp")  # physical order, not written order


def test_tp_varies_fastest_then_dp_then_pp():
    mesh = parse_mesh("pp=2,tp=2,dp=2")
    assert [(c["pp"], c["dp"], c["tp"]) for c in map(mesh.coords, range(8))] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    hsdp = parse_mesh("dp=2,fsdp=2")
    assert [hsdp.data_rank(r) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize("text,message", [
    ("0x2", "axis dp has size 0"),
    ("2x-1", "size -1 of axis tp is not a whole number|axis tp has size -1"),
    ("dp=2,foo=2", "unknown axis 'foo'"),
    ("dp=2,dp=2", "given twice"),
    ("2x2x2x2x2", "gives 5 sizes but the axis order dp x tp x pp x cp names only 4"),
    ("ep=2", r"ep=2 does not divide dp=1; ep is folded over the dp ranks.*--mesh dp=2,ep=2"),
    ("dp=6,ep=4", "ep=4 does not divide dp=6"),
    ("fsdp=6,ep=4", "ep=4 does not divide fsdp=6; ep is folded over the fsdp ranks"),
    ("twox2", "is not a whole number"),
])
def test_bad_meshes(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_mesh(text)


def test_ep_folds_over_the_data_ranks():
    # Megatron-Core's parallel folding: ep adds no ranks; dp=4 with ep=2 is 2 expert-data x 2 ep
    mesh = parse_mesh("dp=4,tp=2,ep=2")
    assert mesh == MeshSpec.of(dp=2, ep=2, tp=2) and mesh.world_size == 8 and mesh.data_size == 4
    assert [mesh.data_rank(r) for r in range(0, 8, 2)] == [0, 1, 2, 3]  # every data rank once, tp inside
    assert [mesh.coords(r)["ep"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # ep neighbours after tp
    assert mesh.describe() == "dp=4 [ep=2 x expert-data 2] x tp=2 (8 ranks)"


def test_ep_folds_over_fsdp_where_the_mesh_has_it():
    # torchtitan's layout: ep carved out of the fsdp ranks; dense parameters sharded over all
    # of them (fsdp x ep), experts over the fsdp ranks that hold the same experts; with HSDP
    # (dp x fsdp) dp stays the replicas' axis
    specs = mixtral.param_specs(mixtral.Config(vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4,
                                               n_kv_heads=2, d_ff=128, moe=MoE(n_experts=4, top_k=2)))
    mesh = parse_mesh("dp=2,fsdp=4,ep=2")
    assert mesh.ep_over == "fsdp" and mesh.size("fsdp") == 2 and mesh.size("dp") == 2 and mesh.data_size == 8
    assert mesh.describe() == "dp=2 x fsdp=4 [ep=2 x expert-fsdp 2] (8 ranks)"
    plan = make_plan(specs, mesh, preset("fsdp"))
    dense = plan.params["blocks.0.attn.wq"]
    assert dense.data_axes["param"] == ("fsdp", "ep") and dense.local_shape() == (16, 4, 16)
    assert dense.replica_axes(("dp", "fsdp", "ep")) == ("dp",)
    w = plan.params["blocks.0.moe.w_gate"]
    assert w.ep_dim == 0 and w.data_axes["param"] == ("fsdp",) and w.local_shape() == (2, 32, 128)
    assert w.replica_axes(("dp", "fsdp", "ep")) == ("dp",)  # ep: the all-to-all's backward sums it


def test_experts_split_over_ep_and_the_rest_over_every_data_rank():
    specs = mixtral.param_specs(mixtral.Config(vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4,
                                               n_kv_heads=2, d_ff=128, moe=MoE(n_experts=4, top_k=2)))
    plan = make_plan(specs, parse_mesh("dp=4,ep=2"), preset("zero1"))
    w = plan.params["blocks.0.moe.w_gate"]
    assert w.ep_dim == 0 and w.local_shape() == (2, 64, 128) and w.placement_names("param", plan.mesh) == ["R", "S(0)"]
    assert w.data_axes["opt"] == ("dp",) and w.local_shape("opt") == (2, 32, 128)  # ZeRO over expert-data only
    assert w.replica_axes(("dp", "ep")) == ()  # summed over ep by the all-to-all's backward, over dp by ZeRO
    dense = plan.params["blocks.0.attn.wq"]
    assert dense.data_axes["opt"] == ("dp", "ep") and dense.replica_axes(("dp", "ep")) == ()  # ZeRO over all 4
    router = plan.params["blocks.0.moe.router"]
    assert router.ep_dim is None and router.data_axes["opt"] == ("dp", "ep")
    assert w.placement_names("opt", plan.mesh) == ["S(1)", "S(0)"]
    with pytest.raises(ConfigError, match=r"ep=2 splits the experts of MoE layers, and no parameter is split over ep"):
        make_plan(tiny(), parse_mesh("dp=2,ep=2"), preset("megatron"))
    with pytest.raises(ConfigError, match="3 experts, which ep=2 does not divide"):
        make_plan(mixtral.param_specs(mixtral.Config(vocab_size=256, max_seq_len=64, d_model=64, n_layers=1, n_heads=4,
                                                     n_kv_heads=2, d_ff=128, moe=MoE(n_experts=3, top_k=2))),
                  parse_mesh("dp=2,ep=2"), preset("megatron"))
    with pytest.raises(ConfigError, match="the ep axis splits the experts of a MoE layer"):
        make_plan(specs, parse_mesh("dp=2,ep=2"), Strategy({"expert": "tp", "embed": "ep"}))
    zero3 = make_plan(specs, parse_mesh("dp=4,ep=2"), preset("zero3")).params  # gathered over two groups
    assert zero3["blocks.0.moe.w_up"].data_axes["param"] == ("dp",)
    assert zero3["blocks.0.attn.wq"].data_axes["param"] == ("dp", "ep")


def test_world_size_mismatch_names_both_numbers_and_a_command():
    with pytest.raises(ConfigError, match=r"needs 4 processes but the world size is 2.*--nproc-per-node=4"):
        check_world_size(parse_mesh("2x2"), 2)


def test_megatron_placements():
    plan = make_plan(tiny(), parse_mesh("dp=2,tp=2"), preset("megatron"))
    p = plan.params
    assert p["blocks.0.attn.wqkv"].tp_dim == 2  # heads: column parallel
    assert p["blocks.0.attn.wo"].tp_dim == 0  # heads on the input side: row parallel
    assert p["blocks.0.mlp.w_in"].tp_dim == 1 and p["blocks.0.mlp.w_out"].tp_dim == 0
    assert p["embed.tokens"].tp_dim == 0  # vocab parallel
    assert p["blocks.0.attn_norm.scale"].tp_dim is None
    assert p["blocks.0.mlp.w_in"].placement_names("param", plan.mesh) == ["R", "S(1)"]
    assert p["blocks.0.mlp.w_in"].local_shape() == (64, 128)


def test_zero_stages_shard_more_state_over_dp():
    specs = tiny()
    mesh = parse_mesh("dp=2")
    by_stage = [make_plan(specs, mesh, Strategy(MEGATRON, z)).bytes_per_rank() for z in range(4)]
    full = by_stage[0]
    assert by_stage[1]["opt"] < full["opt"] and by_stage[1]["grad"] == full["grad"]
    assert by_stage[2]["grad"] < full["grad"] and by_stage[2]["param"] == full["param"]
    assert by_stage[3]["param"] < full["param"]
    lay = make_plan(specs, mesh, preset("zero3")).params["blocks.0.mlp.w_out"]
    assert lay.zero_dim == 1 and lay.data_axes["param"] == ("dp",)  # the embed dim of [mlp, embed]


def test_fsdp_with_tp_splits_different_dims():
    plan = make_plan(llama.param_specs(llama.Config(n_layers=1, n_kv_heads=8)), parse_mesh("fsdp=8,tp=4"),
                     preset("fsdp"))
    wq = plan.params["blocks.0.attn.wq"]
    assert (wq.zero_dim, wq.tp_dim, wq.local_shape()) == (0, 1, (512, 8, 128))


def test_vocab_padded_for_tp():
    plan = make_plan(tiny(vocab_size=255), parse_mesh("tp=2"), preset("megatron"))
    assert plan.params["embed.tokens"].shape == (256, 64)
    assert any("padded to 256" in n for n in plan.notes)
    unsplit = make_plan(tiny(vocab_size=255), parse_mesh("dp=2"), preset("megatron"))
    assert unsplit.params["embed.tokens"].shape == (255, 64)


@pytest.mark.parametrize("specs,mesh,strategy,message", [
    (tiny(), "tp=3", preset("megatron"), r"blocks.0.attn.wqkv: dim 2 \(heads\) has size 4, which tp=3 does not divide"),
    (tiny(), "tp=2", Strategy({"heads": "tp", "head_dim": "tp"}, 0),
     r"the tp axis would split both dim 2 \(heads\) and dim 3 \(head_dim\)"),
    (tiny(), "tp=2", Strategy({"headz": "tp"}, 0), "rules name the logical axis 'headz'"),
    # the batch is split over the data axes by construction: a rule for it would be ignored
    (tiny(), "dp=2,tp=2", Strategy({"batch": "tp"}, 0), "rules map 'batch' to 'tp': the batch is always split"),
    (tiny(), "tp=2", Strategy({"heads": "tpp"}, 0), "names the mesh axis 'tpp', which does not exist"),
    (tiny(), "fsdp=3", preset("fsdp"),
     r"embed.tokens: dim 1 \(embed\) has size 64, which the data axes fsdp \(size 3\) do not divide"),
    (tiny(), "dp=2,fsdp=2", Strategy({"embed": "fsdp"}, 1), "zero 1 shards optimizer state over dp, but the rules"),
    (tiny(), "pp=2", preset("megatron"), "has pp=2 but no stage split was given"),
    (tiny(), "tp=2", Strategy({"embed": ("tp", "fsdp")}, 0), None),
])
def test_plan_validation(specs, mesh, strategy, message):
    if message is None:  # embed over tp is allowed (a different layout), just not useful
        make_plan(specs, parse_mesh(mesh), strategy)
        return
    with pytest.raises(ConfigError, match=message):
        make_plan(specs, parse_mesh(mesh), strategy)


def test_strategy_from_config():
    s = strategy_from(ParallelConfig(rules="zero2", sequence_parallel=True))
    assert s.zero == 2 and s.rules["seq"] == "tp"
    assert strategy_from(ParallelConfig(rules="megatron", zero=3)).zero == 3
    with pytest.raises(ConfigError, match="unknown sharding preset 'megatronn'"):
        strategy_from(ParallelConfig(rules="megatronn"))
    # rules written by hand in a config file: 2-D FSDP x TP
    mine = strategy_from(ParallelConfig(rules={"embed": "fsdp", "mlp": "tp", "heads": "tp"}))
    plan = make_plan(tiny(), parse_mesh("fsdp=2,tp=2"), mine)
    w_in = plan.params["blocks.0.mlp.w_in"]
    assert w_in.placement_names("param", plan.mesh) == ["S(0)", "S(1)"] and w_in.local_shape() == (32, 128)
    assert plan.params["embed.tokens"].tp_dim is None  # vocab not in these rules: replicated over tp


def test_explain_table():
    text = make_plan(tiny(), parse_mesh("dp=2,tp=2"), preset("zero1")).explain()
    assert "mesh: dp=2 x tp=2 (4 ranks)" in text
    assert "blocks.0.mlp.w_in" in text and "R S(1) | opt S(0) S(1)" in text
    assert "per rank: parameters" in text
