"""Llama-2-70B: grouped-query attention (8 key/value heads), the Llama 2 paper's settings.
A size to plan for (``run.py plan --config configs/llama2_70b.py --mesh 8x4x2``)."""

from fxmega.config import ComputeConfig, DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import llama

config = RunConfig(
    name="llama2_70b",
    model=llama.Config(vocab_size=32000, max_seq_len=4096, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       d_ff=28672, rope_theta=10000.0, norm_eps=1e-5),
    train=TrainConfig(steps=500_000, micro_batch_size=1, global_batch_size=1024, seq_len=4096,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=1.5e-4, min_lr=1.5e-5, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-5),
    compute=ComputeConfig(precision="bf16", recompute="full"),
    # Meta's SentencePiece model is licensed, not fetched: download tokenizer.model from the
    # model's Hugging Face page and pass --tokenizer sentencepiece:PATH/tokenizer.model
    data=DataConfig(tokenizer="sentencepiece:tokenizer.model"),
)
