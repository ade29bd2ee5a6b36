"""Time to accuracy: an MLP on Fashion-MNIST, 2 nodes x 1 worker (the time_to_accuracy study).

  python -m studies.time_to_accuracy.run --config configs/tta_fmnist_mlp.py
  sparsejax train configs/tta_fmnist_mlp.py --workdir runs/tta     # one run, 2 CPU devices

Model: MLP 784-1024-1024-10 (1,863,690 parameters, a 7.5 MB float32 gradient); matmul-bound, so
XLA:CPU and PyTorch's CPU kernels cost about the same per step (see the study's parity table).
Data: Fashion-MNIST (60,000 train / 10,000 test, IDX files of Debian's dataset-fashion-mnist).
Recipe: global batch 256, SGD with Nesterov momentum 0.9, peak learning rate 0.1 after a 0.2-epoch
warm-up, cosine decay over 2 epochs, weight decay 5e-4 on the kernels; HiTopKComm at density 0.01
with MSTopK, error feedback and a 0.2-epoch DGC density warm-up from 0.25.
Mesh: one worker per node. On this 2-core machine each emulated node is one process on one core;
a second device per process would make the core also do the other GPU's work (its replica of the
optimizer update, the intra-node copies: 1.5x the step here), which a node's GPUs do in parallel.
With one worker per node, hierarchical = dense and HiTopKComm = TopK all-gather between nodes.
Target: test accuracy 0.85, evaluated every 12 steps (the clock stopped while evaluating).
Expected: 0.85 after about 140-180 of the 468 steps (0.6-0.8 epoch); about 0.88 at the end.
`sparsejax train` takes 1-2 minutes on 2 CPU cores; the study (every system, one
seed, with its bandwidth sweep) about 15 minutes.
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.seed = 0
  config.model.name = "mlp"
  config.model.hidden = (1024, 1024)
  config.data.name = "fashion_mnist"
  config.mesh.nodes = 2
  config.mesh.local = 1
  config.mesh.num_devices = 2
  config.batch_size = 256
  config.num_epochs = 2.0
  config.optimizer.name = "sgd"
  config.optimizer.learning_rate = 0.1
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 5e-4
  config.optimizer.warmup_epochs = 0.2
  config.optimizer.schedule = "cosine"
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.01
  config.compression.selector = "mstopk"
  config.compression.warmup_epochs = 0.2
  config.compression.warmup_density = 0.25
  config.target_metric = "accuracy"
  config.target_value = 0.85
  config.log_every_steps = 12
  config.eval_every_steps = 12
  return config
