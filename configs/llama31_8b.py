"""Llama-3.1-8B: Llama-3-8B's shape with a 128K-token context through Llama 3.1's RoPE scaling
(factor 8 over the 8,192 positions of pre-training; Meta's config.json on Hugging Face,
meta-llama/Llama-3.1-8B: rope_scaling llama3, factor 8, low/high frequency factors 1 and 4)."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import llama
from fxmega.ops.rope import RopeScaling

config = RunConfig(
    name="llama31_8b",
    model=llama.Config(vocab_size=128256, max_seq_len=131072, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, d_ff=14336, rope_theta=500000.0, norm_eps=1e-5,
                       rope_scaling=RopeScaling("llama3", factor=8.0, original_max_seq_len=8192,
                                                low_freq_factor=1.0, high_freq_factor=4.0)),
    train=TrainConfig(steps=500_000, micro_batch_size=1, global_batch_size=512, seq_len=8192,
                      eval_interval=1000, eval_iters=50),
    optim=OptimConfig(lr=3e-4, min_lr=3e-6, warmup_steps=2000, weight_decay=0.1, beta2=0.95, eps=1e-5),
    # Meta's tokenizer is licensed, not fetched: download tokenizer.json from the model's
    # Hugging Face page and pass --tokenizer hf:PATH/tokenizer.json
    data=DataConfig(tokenizer="hf:tokenizer.json"),
)
