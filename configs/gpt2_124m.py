"""GPT-2 small (124M), with the batch and schedule of nanoGPT's OpenWebText run."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import gpt

config = RunConfig(
    name="gpt2_124m",
    model=gpt.Config(vocab_size=50257, max_seq_len=1024, d_model=768, n_layers=12, n_heads=12),
    train=TrainConfig(steps=600_000, micro_batch_size=12, global_batch_size=480, seq_len=1024,
                      eval_interval=2000, eval_iters=200),
    optim=OptimConfig(lr=6e-4, min_lr=6e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95),
    # GPT-2's own BPE (the rank file is fetched once into data/vocab)
    data=DataConfig(tokenizer="gpt2"),
)
