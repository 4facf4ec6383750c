"""Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088): Mistral 7B's
shape with every MLP replaced by 8 experts, each token through 2; 46.7B parameters, 12.9B
active per token (the paper's Section 2 and Mistral AI's announcement). Shapes from
mistralai/Mixtral-8x7B-v0.1's config.json: d_model 4096, 32 layers, 32 heads, 8 kv heads,
expert width 14336, vocabulary 32000, rope_theta 1e6, router_aux_loss_coef 0.02."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import mixtral
from fxmega.ops.moe import MoE

config = RunConfig(
    name="mixtral_8x7b",
    model=mixtral.Config(vocab_size=32000, max_seq_len=32768, d_model=4096, n_layers=32, n_heads=32,
                         n_kv_heads=8, d_ff=14336, rope_theta=1e6, norm_eps=1e-5,
                         moe=MoE(n_experts=8, top_k=2, aux_loss_coeff=0.02)),
    train=TrainConfig(steps=250_000, micro_batch_size=1, global_batch_size=1024, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-5),
    # the tokenizer is Mistral's: download tokenizer.json from the model's Hugging Face page
    data=DataConfig(tokenizer="hf:tokenizer.json"),
)
