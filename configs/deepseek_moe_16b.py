"""DeepSeekMoE 16B (Dai et al. 2024, "DeepSeekMoE: Towards Ultimate Expert Specialization",
arXiv:2401.06066): 64 fine-grained routed experts of which each token takes 6, 2 shared
experts every token passes through, the first layer dense; 16.4B parameters, 2.8B active
(the paper's Table of DeepSeekMoE 16B). Shapes from deepseek-ai/deepseek-moe-16b-base's
config.json: d_model 2048, 28 layers, 16 heads, dense width 10944, expert width 1408,
vocabulary 102400, softmax scores without renormalising the top 6, aux_loss_alpha 0.001."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import mixtral
from fxmega.ops.moe import MoE

config = RunConfig(
    name="deepseek_moe_16b",
    model=mixtral.Config(vocab_size=102400, max_seq_len=4096, d_model=2048, n_layers=28, n_heads=16,
                         d_ff=10944, rope_theta=10000.0, norm_eps=1e-6,
                         moe=MoE(n_experts=64, top_k=6, d_expert=1408, n_shared_experts=2, first_dense_layers=1,
                                 norm_topk=False, aux_loss_coeff=0.001)),
    # training settings approximate the paper's (about 2T tokens in batches of 4.5K x 4K tokens)
    train=TrainConfig(steps=106_000, micro_batch_size=1, global_batch_size=4608, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=4.2e-4, min_lr=4.2e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-8),
    data=DataConfig(tokenizer="hf:tokenizer.json"),
)
