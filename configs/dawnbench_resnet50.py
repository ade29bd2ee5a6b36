"""DAWNBench ResNet-50: ImageNet to 93% top-5 in 28 epochs with progressive resizing, LARS and
HiTopKComm on 16 nodes x 8 GPUs (Shi et al., MLSys 2021, set the record at about 2.5 minutes on
128 V100s over 25 Gbps Ethernet).

  sparsejax launch --nodes 16 --procs-per-node 1 -- train configs/dawnbench_resnet50.py \\
      --set data.path=$TFDS_DATA_DIR

Recipe (the published entry's ingredients): 28 epochs, global batch 32,768 (256 per GPU), LARS
(trust coefficient 0.001, momentum 0.9, weight decay 5e-5 on kernels) with a 5-epoch linear
warm-up to 29.0 and polynomial (power 2) decay, the large-batch LARS settings of You et al.
("ImageNet Training in Minutes", 2018); label smoothing 0.1; images of 128 px for epochs 0-12,
224 px for 13-24 and 288 px for 25-27 (fast.ai's DAWNBench progressive-resizing schedule);
HiTopKComm at density 0.001 after a DGC warm-up from 0.25 over the first 2 epochs.
Expected: top-5 >= 93% at the end; the wall time at which top-5 first reaches 93% (evaluated at
each stage's end and at the end) is `time_to_target` in summary.json: the DAWNBench figure. Not
yet run on real ImageNet (needs a GPU cluster); its whole code path runs in CI on a generated
ImageNet (tests/test_dawnbench.py). Data: `sparsejax prepare imagenet --manual-dir DIR
--data-dir $TFDS_DATA_DIR` once; decoded low-resolution images are cached under
data.cache_dir (set it to a local disk).
"""

from sparsejax.train.config import default_config


def get_config():
  config = default_config()
  config.model.name = "resnet50"
  config.model.dtype = "bfloat16"
  config.data.name = "imagenet2012"
  config.data.resize_schedule = ((0, 128), (13, 224), (25, 288))
  config.mesh.nodes = 16
  config.mesh.local = 8
  config.batch_size = 32768
  config.num_epochs = 28.0
  config.label_smoothing = 0.1
  config.optimizer.name = "lars"
  config.optimizer.learning_rate = 29.0
  config.optimizer.warmup_epochs = 5.0
  config.optimizer.schedule = "poly"
  config.optimizer.poly_power = 2.0
  config.optimizer.momentum = 0.9
  config.optimizer.trust_coefficient = 0.001
  config.optimizer.weight_decay = 5e-5
  config.compression.algorithm = "hitopk"
  config.compression.density = 0.001
  config.compression.warmup_epochs = 2.0
  config.compression.warmup_density = 0.25
  config.log_every_steps = 10
  config.eval_every_steps = 0
  config.eval_at_stage_boundaries = True
  config.target_metric = "top5_accuracy"  # time to 93% top-5 goes into summary.json
  config.target_value = 0.93
  config.checkpoint_every_steps = 500
  return config
