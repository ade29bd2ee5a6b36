"""ResNet-50 on ImageNet (ILSVRC-2012), the 90-epoch recipe (Goyal et al. 2017), with HiTopKComm.

  sparsejax train configs/resnet50_imagenet.py --workdir runs/resnet50 \\
      --set data.path=$TFDS_DATA_DIR

Hardware: 1 node x 8 GPUs (mesh 1 x 8; on several nodes set mesh.nodes, e.g. --set mesh.nodes=4).
Recipe: global batch 1024, SGD with Nesterov momentum 0.9, learning rate 0.1 per 256 images
(0.4) after a 5-epoch linear warm-up, cosine decay, weight decay 5e-5 on kernels only, label
smoothing 0.1, 224 px. Compression: HiTopKComm at density 0.01 after a DGC warm-up from 0.25
over 4 epochs. Expected: ~76% top-1 (the dense recipe's published result; not yet run here).
Data: `sparsejax prepare imagenet --manual-dir DIR --data-dir $TFDS_DATA_DIR` once.
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.model.name = "resnet50"
  config.model.dtype = "bfloat16"
  config.data.name = "imagenet2012"
  config.data.resize_schedule = ((0, 224),)
  config.mesh.nodes = 1
  config.mesh.local = -1
  config.batch_size = 1024
  config.num_epochs = 90.0
  config.label_smoothing = 0.1
  config.optimizer.name = "sgd"
  config.optimizer.learning_rate = 0.4
  config.optimizer.momentum = 0.9
  config.optimizer.nesterov = True
  config.optimizer.weight_decay = 5e-5
  config.optimizer.warmup_epochs = 5.0
  config.optimizer.schedule = "cosine"
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.01
  config.compression.warmup_epochs = 4.0
  config.compression.warmup_density = 0.25
  config.log_every_steps = 100
  config.eval_every_steps = 5000
  config.checkpoint_every_steps = 5000
  return config
