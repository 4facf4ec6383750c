"""GPT-2 XL (1.5B)."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import gpt

config = RunConfig(
    name="gpt2_xl",
    model=gpt.Config(vocab_size=50257, max_seq_len=1024, d_model=1600, n_layers=48, n_heads=25),
    train=TrainConfig(steps=300_000, micro_batch_size=4, global_batch_size=512, seq_len=1024,
                      eval_interval=2000, eval_iters=100),
    optim=OptimConfig(lr=2e-4, min_lr=2e-5, warmup_steps=2000, weight_decay=0.1),
    # GPT-2's own BPE (the rank file is fetched once into data/vocab)
    data=DataConfig(tokenizer="gpt2"),
)
