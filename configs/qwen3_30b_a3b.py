"""Qwen3-30B-A3B (Qwen Team 2025, "Qwen3 Technical Report", arXiv:2505.09388, Table 2; the
model card of Qwen/Qwen3-30B-A3B-Base): 30.5B parameters, 3.3B activated per token. Shapes
from its config.json: d_model 2048, 48 layers, 32 query heads and 4 key/value heads of width
128 (head_dim, apart from d_model / heads), RMS-normalised queries and keys, 128 experts of
width 768 (moe_intermediate_size), each token through 8 with renormalised weights
(norm_topk_prob), no shared experts, every layer sparse, vocabulary 151,936, untied head,
rope_theta 1e6, rms_norm_eps 1e-6, router_aux_loss_coef 0.001."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import mixtral
from fxmega.ops.moe import MoE

config = RunConfig(
    name="qwen3_30b_a3b",
    model=mixtral.Config(vocab_size=151936, max_seq_len=32768, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                         d_head=128, qk_norm=True, d_ff=6144, rope_theta=1e6, norm_eps=1e-6,
                         moe=MoE(n_experts=128, top_k=8, d_expert=768, norm_topk=True, aux_loss_coeff=0.001)),
    train=TrainConfig(steps=250_000, micro_batch_size=1, global_batch_size=1024, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-8),
    # the tokenizer is Qwen's: download tokenizer.json from the model's Hugging Face page
    data=DataConfig(tokenizer="hf:tokenizer.json"),
)
