"""The default run (`make run`): a small byte-level GPT on the 42 Shakespeare plays.

Sized to learn visibly within about ten minutes on 2 CPU cores: validation loss falls from
5.5 (uniform over 256 bytes) well below 3.33 nats (the corpus' byte unigram entropy).
"""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import gpt

config = RunConfig(
    name="shakespeare_gpt",
    model=gpt.Config(vocab_size=256, max_seq_len=128, d_model=192, n_layers=4, n_heads=6),
    train=TrainConfig(steps=800, micro_batch_size=32, global_batch_size=32, seq_len=128,
                      eval_interval=200, eval_iters=20, log_interval=50,
                      log_jsonl="runs/shakespeare_gpt/log.jsonl",
                      tensorboard_dir="runs/shakespeare_gpt/tensorboard",
                      save_dir="runs/shakespeare_gpt/checkpoints", save_interval=200, keep_last=2,
                      sample_tokens=400, sample_prompt="ROMEO.\n"),
    optim=OptimConfig(lr=3e-3, min_lr=3e-4, schedule="cosine", warmup_steps=50,
                      weight_decay=0.1, beta2=0.99, clip_grad=1.0),
    data=DataConfig(source="shakespeare", data_dir="data"),
)
