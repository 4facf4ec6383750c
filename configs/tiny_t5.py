"""A T5 (gated-GELU feed-forward as in v1.1, the head tied to the embedding as in the original:
it starts near uniform and learns in tens of steps) that pre-trains by span corruption in
seconds: for tests and trying things out. The specials sit above the 256 data ids: pad 256, EOS 257,
and 30 sentinels counting down from 287."""

from fxmega.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from fxmega.models import t5

config = RunConfig(
    name="tiny_t5",
    model=t5.Config(vocab_size=288, encoder_seq_len=32, decoder_seq_len=8, d_model=64, n_encoder_layers=2,
                    n_decoder_layers=2, n_heads=4, d_kv=16, d_ff=128, ffn="gated-gelu", tie_embeddings=True,
                    pad_id=256, eos_id=257, n_sentinels=30),
    train=TrainConfig(steps=20, micro_batch_size=8, global_batch_size=8, seq_len=32,
                      eval_interval=0, eval_iters=2, log_interval=5),
    optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.1),
    data=DataConfig(source="mock"),
)
