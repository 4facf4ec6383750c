"""A Mixtral-style mixture of experts that trains in seconds: 4 experts, top 2, every block,
with the switch balancing loss and the router z-loss; for tests and trials."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import mixtral
from fxmega.ops.moe import MoE

config = RunConfig(
    name="tiny_moe",
    model=mixtral.Config(vocab_size=256, max_seq_len=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=64, moe=MoE(n_experts=4, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001)),
    train=TrainConfig(steps=20, micro_batch_size=4, global_batch_size=8, seq_len=32,
                      eval_interval=0, eval_iters=2, log_interval=5),
    optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1),
    data=DataConfig(source="mock"),
)
