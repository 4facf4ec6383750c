"""Llama-2-7B: the architecture and the optimizer settings of the Llama 2 paper."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import llama

config = RunConfig(
    name="llama2_7b",
    model=llama.Config(vocab_size=32000, max_seq_len=4096, d_model=4096, n_layers=32, n_heads=32,
                       d_ff=11008, rope_theta=10000.0, norm_eps=1e-5),
    train=TrainConfig(steps=500_000, micro_batch_size=1, global_batch_size=1024, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=3e-4, min_lr=3e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-5),
    # Meta's SentencePiece model is licensed, not fetched: download tokenizer.model from the
    # model's Hugging Face page and pass --tokenizer sentencepiece:PATH/tokenizer.model
    data=DataConfig(tokenizer="sentencepiece:tokenizer.model"),
)
