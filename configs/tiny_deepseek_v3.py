"""DeepSeek-V3's architecture at a size that trains in seconds: multi-head latent attention
(query latent 48, key-value latent 32, 16 + 16 query/key dims per head, values 16), YaRN, the
first block dense, then 8 sigmoid-routed experts in 4 groups (2 eligible), top 2, one shared
expert and the auxiliary-loss-free selection bias, one multi-token prediction module; for tests
and trials."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import deepseek_v3
from fxmega.ops.moe import MoE
from fxmega.ops.rope import RopeScaling

config = RunConfig(
    name="tiny_deepseek_v3",
    model=deepseek_v3.Config(
        vocab_size=256, max_seq_len=64, d_model=64, n_layers=3, n_heads=4, d_ff=128, q_lora_rank=48,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
        rope_scaling=RopeScaling(kind="yarn", factor=2.0, original_max_seq_len=32), mscale_all_dim=1.0, init_std=0.02,
        moe=MoE(n_experts=8, top_k=2, d_expert=32, n_shared_experts=1, first_dense_layers=1, score="sigmoid",
                n_groups=4, topk_groups=2, route_scale=2.5, expert_bias=True),
        mtp_depth=1),
    train=TrainConfig(steps=20, micro_batch_size=4, global_batch_size=8, seq_len=32,
                      eval_interval=0, eval_iters=2, log_interval=5),
    optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1),
    data=DataConfig(source="mock"),
)
