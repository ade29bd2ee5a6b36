"""Transformer "base" (Vaswani et al. 2017) on WMT14 English -> German, HiTopKComm on 8 nodes x 8.

  sparsejax prepare wmt14 --data-dir $TFDS_DATA_DIR        # once: TFDS downloads and builds it
  srun sparsejax train configs/transformer_wmt.py --set data.path=$TFDS_DATA_DIR

Hardware: 8 nodes x 8 GPUs (64 workers; other meshes with --set mesh.nodes=N mesh.local=G and
a batch_size divisible by N * G). Data: TFDS `wmt14_translate/de-en` (4.5M training pairs;
newstest2013 for validation, newstest2014 as `--set data.eval_split=test`), a joint BPE of 32,000
pieces trained with sentencepiece on 2M sentences of the training set (cached), sentences cut
at 128 tokens. Model: encoder-decoder, 6+6 layers, d_model 512, 8 heads, d_ff 2048, dropout 0.1,
post-LN, sinusoidal positions, shared embeddings (60.5M parameters at 32K pieces). AdamW
(b2 0.98, eps 1e-9), linear warm-up over half an epoch (~560 steps) to 1e-3, then cosine; label
smoothing 0.1; HiTopKComm at density 0.01 after a DGC warm-up over the first epoch.
Expected: not run here (no GPU cluster, and WMT14 cannot be downloaded on the development
machine). The recipe is the base model's, which reaches 27.3 BLEU on newstest2014 in 100K steps
of 25K tokens each (Vaswani et al.); 20 epochs at 4,096 pairs (~110K tokens) per step is about
22K steps. sparsejax reports token-level validation loss and accuracy, not BLEU. The code path
(TSV or TFDS pairs -> joint BPE -> the encoder-decoder in the loop with HiTopKComm) is exercised
on a generated corpus by tests/test_translation.py.
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.model.name = "transformer_base"
  config.data.name = "wmt14"
  config.data.vocab_size = 32000
  config.data.seq_len = 128
  config.data.eval_split = "validation"
  config.mesh.nodes = 8
  config.mesh.local = 8
  config.batch_size = 4096
  config.num_epochs = 20.0
  config.label_smoothing = 0.1
  config.optimizer.name = "adamw"
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_epochs = 0.5
  config.optimizer.schedule = "cosine"
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.98
  config.optimizer.eps = 1e-9
  config.optimizer.weight_decay = 0.0
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.01
  config.compression.warmup_epochs = 1.0
  config.compression.warmup_density = 0.25
  config.log_every_steps = 100
  config.eval_every_steps = 2000
  config.checkpoint_every_steps = 2000
  return config
