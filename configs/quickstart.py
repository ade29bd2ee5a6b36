"""Quickstart: ResNet-20 on scikit-learn's handwritten digits, 8 CPU devices as 2 nodes x 4.

  sparsejax train configs/quickstart.py --workdir runs/quickstart

Hardware: any machine; on a CPU-only one the CLI creates the 8 virtual devices itself.
Compression: HiTopKComm at density 0.01 (1% of the gradient crosses the "node" axis per step),
MSTopK selection, error feedback; the fused SGD with Nesterov momentum on the flat buffer.
Expected: about 1-2 minutes on 2 CPU cores, test accuracy >= 0.95 (0.97-0.99 typical).
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.seed = 0
  config.model.name = "resnet20"
  config.data.name = "digits"
  config.mesh.nodes = 2
  config.mesh.local = 4
  config.mesh.num_devices = 8
  config.batch_size = 128
  config.num_epochs = 30.0
  config.optimizer.name = "sgd"
  config.optimizer.learning_rate = 0.2
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 5e-4
  config.optimizer.warmup_epochs = 2.0
  config.optimizer.schedule = "cosine"
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.01
  config.compression.selector = "mstopk"
  config.compression.warmup_epochs = 3.0
  config.compression.warmup_density = 0.25
  config.log_every_steps = 10
  config.eval_every_steps = 100
  config.checkpoint_every_steps = 100
  return config
