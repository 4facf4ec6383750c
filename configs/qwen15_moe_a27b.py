"""Qwen1.5-MoE-A2.7B (Qwen Team 2024, "Qwen1.5-MoE: Matching 7B Model Performance with 1/3
Activated Parameters", qwenlm.github.io/blog/qwen-moe, and the model card of
Qwen/Qwen1.5-MoE-A2.7B): 14.3B parameters, 2.7B activated per token. Shapes from its
config.json (model_type qwen2_moe): d_model 2048, 24 layers, 16 heads, biases on q, k and v,
60 experts of width 1,408 (moe_intermediate_size), each token through 4 with the weights not
renormalised (norm_topk_prob false), shared experts of width 5,632 (= 4 x 1,408) gated per
token by a sigmoid, every layer sparse, vocabulary 151,936, untied head, rope_theta 1e6,
rms_norm_eps 1e-6, router_aux_loss_coef 0.001."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import mixtral
from fxmega.ops.moe import MoE

config = RunConfig(
    name="qwen15_moe_a27b",
    model=mixtral.Config(vocab_size=151936, max_seq_len=8192, d_model=2048, n_layers=24, n_heads=16, qkv_bias=True,
                         d_ff=5632, rope_theta=1e6, norm_eps=1e-6,
                         moe=MoE(n_experts=60, top_k=4, d_expert=1408, n_shared_experts=4, shared_gate=True,
                                 norm_topk=False, aux_loss_coeff=0.001)),
    train=TrainConfig(steps=250_000, micro_batch_size=1, global_batch_size=1024, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-8),
    # the tokenizer is Qwen's: download tokenizer.json from the model's Hugging Face page
    data=DataConfig(tokenizer="hf:tokenizer.json"),
)
