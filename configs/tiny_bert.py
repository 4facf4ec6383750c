"""A BERT that pre-trains (masked LM) in seconds: for tests and trying things out. The
vocabulary holds the 256 byte ids plus [CLS], [SEP] and [MASK] (ids 256-258)."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import bert

config = RunConfig(
    name="tiny_bert",
    model=bert.Config(vocab_size=259, max_seq_len=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, pooler=False),
    train=TrainConfig(steps=30, micro_batch_size=8, global_batch_size=8, seq_len=32,
                      eval_interval=0, eval_iters=2, log_interval=5),
    optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.01),
    data=DataConfig(source="mock"),
)
