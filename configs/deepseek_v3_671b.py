"""DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv:2412.19437): 671B
parameters, 37B activated per token. Shapes from deepseek-ai/DeepSeek-V3's config.json:
d_model 7168, 61 layers (the first 3 dense, width 18432), 128 heads of MLA (query latent
1536, key-value latent 512, 128 + 64 query/key dims, values 128), 256 routed experts of
width 2048 in 8 groups (4 eligible per token), top 8, one shared expert, sigmoid scores
scaled by 2.5, the auxiliary-loss-free bias (update speed 0.001, report section 4.2),
vocabulary 129280, YaRN to 128K (factor 40 over 4096, mscale 1.0 on the tables and the
softmax). One multi-token prediction module (report section 2.2), its loss weighed 0.3 (the
report's weight for the first 10T tokens, 0.1 after): 11.6B parameters beside the 671B,
which with its own copies of the embedding and head (shared here) make the 685B of the
published checkpoint. Training settings follow the report's pre-training (section 4.2):
sequences of 4096, batch ramped to 15360, peak lr 2.2e-4, AdamW betas (0.9, 0.95), weight
decay 0.1; bf16 compute (the report's is FP8 for most products, section 3.3).

On paper (docs/models.md): the report's layout, 16 pipeline stages and 64-way expert
parallelism over ZeRO-1 data parallelism on 2048 GPUs (section 3.2), fits 80 GB with full
recompute and an expert capacity of 1.25:

    python run.py plan --config configs/deepseek_v3_671b.py --mesh pp=16,dp=128,ep=64 --zero 1 \
        --recompute full --set model.moe.capacity_factor=1.25 --memory-per-device 80GB
"""

from fxmega.config import ComputeConfig, DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import deepseek_v3
from fxmega.ops.moe import MoE
from fxmega.ops.rope import RopeScaling

config = RunConfig(
    name="deepseek_v3_671b",
    model=deepseek_v3.Config(
        vocab_size=129280, max_seq_len=163840, d_model=7168, n_layers=61, n_heads=128, d_ff=18432, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0,
        rope_scaling=RopeScaling(kind="yarn", factor=40.0, original_max_seq_len=4096, beta_fast=32.0, beta_slow=1.0,
                                 attention_factor=1.0),
        mscale_all_dim=1.0, norm_eps=1e-6, init_std=0.006,
        moe=MoE(n_experts=256, top_k=8, d_expert=2048, n_shared_experts=1, first_dense_layers=3, score="sigmoid",
                n_groups=8, topk_groups=4, route_scale=2.5, expert_bias=True, bias_update_rate=0.001),
        mtp_depth=1, mtp_loss_weight=0.3),
    train=TrainConfig(steps=970_000, micro_batch_size=1, global_batch_size=15360, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    compute=ComputeConfig(precision="bf16"),
    optim=OptimConfig(lr=2.2e-4, min_lr=2.2e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-8),
    data=DataConfig(tokenizer="hf:tokenizer.json"),
)
