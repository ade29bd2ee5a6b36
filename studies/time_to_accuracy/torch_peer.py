"""The PyTorch DDP peer of the time-to-accuracy study: the task's model built in PyTorch with
flax's initialisation, the same batches, schedule, optimizer and weight-decay rule.

Models: `mlp` (`torch_mlp`, `sparsejax.models.MLP`), `transformer_lm` (`TorchTransformerLM`,
`sparsejax.models.TransformerLM`: learned positions, pre-LN, the output projection tied to the
token embedding) and the ResNets of basic blocks (`torch_resnet`, `sparsejax.models.ResNet`:
flax's SAME padding, BatchNorm, zero-initialised last scale). Optimizers: SGD (momentum,
Nesterov), AdamW (decoupled decay, as optax's `adamw`) and LARS (`torch_lars`, as optax's
`lars`), decay and trust ratio on kernels only (`p.dim() > 1`, the trainer's `decay_mask`).
Label smoothing and progressive resizing (the size of each step's epoch, evaluation at the
last step's size) as `sparsejax train`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

TRUNC = 0.87962566103423978  # std of a unit normal truncated at 2 std: flax's lecun_normal


def _lecun(weight, fan_in: int) -> None:
  """flax's lecun_normal: truncated at 2 std, variance 1/fan_in."""
  import torch
  std = 1.0 / math.sqrt(fan_in) / TRUNC
  torch.nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def _linear(fan_in: int, fan_out: int):
  import torch
  lin = torch.nn.Linear(fan_in, fan_out)
  _lecun(lin.weight, fan_in)
  torch.nn.init.zeros_(lin.bias)
  return lin


def torch_mlp(in_dim: int, hidden: tuple[int, ...], num_classes: int):
  """`sparsejax.models.MLP` in PyTorch, with flax's initialisation (kernels: truncated normal,
  variance 1/fan_in, i.e. lecun_normal; biases zero)."""
  import torch
  layers: list[Any] = []
  widths = (in_dim, *hidden, num_classes)
  for i in range(len(widths) - 1):
    layers.append(_linear(widths[i], widths[i + 1]))
    if i < len(widths) - 2:
      layers.append(torch.nn.ReLU())
  return torch.nn.Sequential(*layers)


def _block_class():
  import torch
  from torch import nn

  class Block(nn.Module):
    """One pre-LN decoder layer: x + attn(ln(x)), then x + mlp(ln(x)); flax's parameters."""

    def __init__(self, d: int, heads: int, d_ff: int):
      super().__init__()
      self.heads = heads
      self.ln_self, self.ln_mlp = nn.LayerNorm(d, eps=1e-6), nn.LayerNorm(d, eps=1e-6)
      self.q, self.k, self.v, self.o = (_linear(d, d) for _ in range(4))
      self.wi, self.wo = _linear(d, d_ff), _linear(d_ff, d)

    def forward(self, x):
      b, t, d = x.shape
      h = self.ln_self(x)
      q, k, v = (f(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                 for f in (self.q, self.k, self.v))
      a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
      return x + self.wo(torch.relu(self.wi(self.ln_mlp(x))))

  return Block


def torch_transformer_lm(vocab_size: int, d_model: int, num_heads: int, d_ff: int,
                         num_layers: int, max_len: int):
  """`sparsejax.models.TransformerLM` (dropout 0) in PyTorch: token embedding normal(d^-1/2)
  scaled by sqrt(d), learned positions normal(0.02), pre-LN layers (LayerNorm eps 1e-6,
  attention and MLP kernels lecun_normal, biases zero), a final LayerNorm and logits
  x @ embedding^T. Input int64[b, t] token ids, output float32[b, t, vocab_size]."""
  import torch
  from torch import nn
  block = _block_class()

  class TransformerLM(nn.Module):
    def __init__(self):
      super().__init__()
      self.embedding = nn.Parameter(torch.randn(vocab_size, d_model) * d_model ** -0.5)
      self.positions = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
      self.layers = nn.ModuleList(block(d_model, num_heads, d_ff) for _ in range(num_layers))
      self.ln_final = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tokens):
      x = self.embedding[tokens] * math.sqrt(d_model) + self.positions[:tokens.shape[-1]]
      for layer in self.layers:
        x = layer(x)
      return self.ln_final(x) @ self.embedding.T

  return TransformerLM()


def _same_pad(size: int, kernel: int, stride: int) -> tuple[int, int]:
  """flax's "SAME" padding of one spatial side: (low, high), the odd pixel on the high side."""
  total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
  return total // 2, total - total // 2


def torch_resnet(stage_sizes: tuple[int, ...], num_filters: int, num_classes: int,
                 in_channels: int, small_inputs: bool = True):
  """`sparsejax.models.ResNet` with basic blocks (ResNet-18/34, the CIFAR ResNets) in PyTorch:
  NHWC input float32[b, h, w, c]; convolutions without bias, flax's "SAME" padding (the odd
  pixel on the high side; the ImageNet stem's 7x7/2: 3 pixels a side) and lecun_normal
  kernels; BatchNorm momentum 0.1 (flax's 0.9), eps 1e-5, each block's last scale zero; a
  projection (1x1 conv + BN) where the shape changes; global mean pool; a dense head
  (lecun_normal, bias zero). `small_inputs`: the CIFAR stem (one 3x3 conv, no max-pool);
  otherwise the 7x7/2 conv and 3x3/2 max-pool."""
  import torch
  from torch import nn
  f = torch.nn.functional

  class Conv(nn.Conv2d):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1,
                 pad: int | None = None):
      super().__init__(cin, cout, kernel, stride, padding=0, bias=False)
      _lecun(self.weight, cin * kernel * kernel)
      self.pad = pad  # None: flax's SAME; else this many pixels each side

    def forward(self, x):
      (top, bottom), (left, right) = (
          (self.pad, self.pad) if self.pad is not None
          else _same_pad(n, self.kernel_size[0], self.stride[0]) for n in x.shape[2:])
      if top or bottom or left or right:
        x = f.pad(x, (left, right, top, bottom))
      return super().forward(x)

  def norm(channels: int, zero: bool = False):
    bn = nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)
    if zero:
      nn.init.zeros_(bn.weight)
    return bn

  class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
      super().__init__()
      self.conv1, self.bn1 = Conv(cin, cout, 3, stride), norm(cout)
      self.conv2, self.bn2 = Conv(cout, cout, 3), norm(cout, zero=True)
      self.proj = (nn.Sequential(Conv(cin, cout, 1, stride), norm(cout))
                   if stride != 1 or cin != cout else None)

    def forward(self, x):
      y = torch.relu(self.bn1(self.conv1(x)))
      y = self.bn2(self.conv2(y))
      return torch.relu((self.proj(x) if self.proj is not None else x) + y)

  class ResNet(nn.Module):
    def __init__(self):
      super().__init__()
      stem = (Conv(in_channels, num_filters, 3) if small_inputs  # (the ImageNet stem: 3 a side)
              else Conv(in_channels, num_filters, 7, 2, pad=3))
      self.stem = nn.Sequential(stem, norm(num_filters), nn.ReLU())
      self.small = small_inputs
      blocks, cin = [], num_filters
      for i, n in enumerate(stage_sizes):
        for j in range(n):
          cout = num_filters * 2**i
          blocks.append(Block(cin, cout, 2 if i > 0 and j == 0 else 1))
          cin = cout
      self.blocks = nn.Sequential(*blocks)
      self.head = _linear(cin, num_classes)

    def forward(self, x):
      x = self.stem(x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last))
      if not self.small:
        (top, bottom), (left, right) = (_same_pad(n, 3, 2) for n in x.shape[2:])
        x = f.max_pool2d(f.pad(x, (left, right, top, bottom), value=-math.inf), 3, 2)
      return self.head(self.blocks(x).mean((2, 3)))

  return ResNet().to(memory_format=torch.channels_last)


def build_model(config, data):
  """The PyTorch twin of the config's model (`mlp`, `transformer_lm`, or a ResNet of basic
  blocks: `resnet18`, `resnet34`, `resnet20`)."""
  m = config.model
  if m.name in ("resnet18", "resnet34", "resnet20"):
    from sparsejax import models
    spec = models.MODELS[m.name].keywords
    return torch_resnet(tuple(spec["stage_sizes"]), m.num_filters or spec.get("num_filters", 64),
                        data.num_classes, data.example(None).shape[-1],
                        spec.get("small_inputs", False))
  if m.name == "mlp":
    in_dim = int(np.prod(data.example(None).shape[1:]))
    return torch_mlp(in_dim, tuple(m.hidden) or (1024, 1024), data.num_classes)
  if m.name == "transformer_lm":
    if m.dropout > 0:
      raise ValueError(f"the PyTorch peer's Transformer has no dropout; set model.dropout=0.0 "
                       f"(got {m.dropout})")
    return torch_transformer_lm(data.num_classes, m.d_model, m.num_heads, m.d_ff, m.num_layers,
                                config.data.seq_len)
  raise ValueError(f"the PyTorch peer builds models 'mlp', 'transformer_lm', 'resnet18', "
                   f"'resnet34' and 'resnet20', got {m.name!r}")


def torch_lars(torch, groups, lr: float, momentum: float, trust_coefficient: float,
               eps: float = 0.0):
  """`optax.lars` (and `sparsejax.optim.fused_lars`) in PyTorch: per parameter
  u = (g + wd p) x ratio, ratio = trust_coefficient ||p|| / (||g + wd p|| + eps) where the group
  has `trust` and both norms are positive (else 1); then the trace t = -lr u + momentum t and
  p += t. Groups: {"params", "weight_decay", "trust"}."""

  class LARS(torch.optim.Optimizer):
    def __init__(self):
      super().__init__(groups, {"lr": lr, "weight_decay": 0.0, "trust": True})

    @torch.no_grad()
    def step(self):
      for group in self.param_groups:
        for p in group["params"]:
          if p.grad is None:
            continue
          u = p.grad + group["weight_decay"] * p if group["weight_decay"] else p.grad.clone()
          if group["trust"]:
            pn, un = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
            ok = (pn > 0) & (un > 0)
            u = u * torch.where(ok, trust_coefficient * pn / (un + eps), torch.ones_like(pn))
          state = self.state[p]
          if "trace" not in state:
            state["trace"] = torch.zeros_like(p)
          t = state["trace"].mul_(momentum).add_(u, alpha=-group["lr"])
          p.add_(t)

  return LARS()


def build_optimizer(torch, model, o):
  """SGD, AdamW or LARS of the config's `optimizer` group, decay (and LARS's trust ratio) on
  kernels only."""
  if o.name not in ("sgd", "adamw", "lars"):
    raise ValueError(f"the PyTorch peer runs optimizers 'sgd', 'adamw' and 'lars', got "
                     f"{o.name!r}")
  decay = [p for p in model.parameters() if p.dim() > 1]
  rest = [p for p in model.parameters() if p.dim() <= 1]
  groups = [{"params": decay, "weight_decay": o.weight_decay},
            {"params": rest, "weight_decay": 0.0}]
  if o.name == "lars":
    if o.nesterov:
      raise ValueError("the PyTorch peer's LARS has no Nesterov momentum; set "
                       "optimizer.nesterov=False")
    groups[1]["trust"] = False
    return torch_lars(torch, groups, o.learning_rate, o.momentum, o.trust_coefficient)
  if o.name == "sgd":
    return torch.optim.SGD(groups, lr=o.learning_rate, momentum=o.momentum, nesterov=o.nesterov)
  # decoupled decay lr * wd * p, as optax.adamw
  return torch.optim.AdamW(groups, lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps)


class TorchRun:
  """One process's share of the PyTorch DDP peer: the same model, batches, schedule and decay."""

  def __init__(self, config, rank: int, world: int, powersgd: bool, distributed: bool = True):
    import torch
    import torch.distributed as dist

    from sparsejax import data as data_lib
    from sparsejax.train import make_plan, schedules
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    self.torch, self.rank, self.world = torch, rank, world
    self.data = data_lib.open_inputs(config)
    self.sequence = config.model.name == "transformer_lm"
    self.flat = config.model.name == "mlp"
    self.label_smoothing = config.label_smoothing
    plan = make_plan(config, self.data.steps_per_epoch)  # (the sparsejax run's, step for step)
    self.plan, self.total = plan, plan.total_steps
    self.sizes = [plan.image_size(s) for s in range(self.total)]
    self.size = self.sizes[0]  # the last step's (evaluated at it)
    model = build_model(config, self.data)
    if distributed:
      model = torch.nn.parallel.DistributedDataParallel(model)
      if powersgd:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, ps.powerSGD_hook)
    self.model, self.dist = model, dist
    self.opt = build_optimizer(torch, model, config.optimizer)
    lr = schedules.learning_rate(config.optimizer, plan)
    self.lrs = [float(lr(s)) for s in range(self.total)]

  def _inputs(self, x: np.ndarray):
    x = np.ascontiguousarray(x)
    if self.sequence:
      return self.torch.from_numpy(x.astype(np.int64))
    return self.torch.from_numpy(x.reshape(len(x), -1) if self.flat else x)

  def _loss(self, logits, labels):
    f = self.torch.nn.functional
    if self.sequence:
      return f.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                             label_smoothing=self.label_smoothing)
    return f.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)

  def step(self, step: int, wait: bool = True, level_step: int | None = None) -> float:
    # dense: one density; progressive resizing: the size of the epoch of step `level_step`
    # (default `step`: `sparsejax train`'s rule)
    self.size = self.sizes[min(step if level_step is None else level_step, self.total - 1)]
    images, labels = self.data.train_batch(step, self.size)
    share = len(labels) // self.world
    rows = slice(self.rank * share, (self.rank + 1) * share)
    y = self.torch.from_numpy(labels[rows].astype(np.int64))
    for group in self.opt.param_groups:
      group["lr"] = self.lrs[min(step, self.total - 1)]
    loss = self._loss(self.model(self._inputs(images[rows])), y)
    self.opt.zero_grad(set_to_none=True)
    loss.backward()
    self.opt.step()
    return loss.item()

  def step_at(self, step: int, at: int) -> float:
    """Batch `step` at the image size of step `at` (the sweep's step, as `Run.step_at`)."""
    return self.step(step, level_step=at)

  def wait(self) -> None:
    pass  # every PyTorch step is synchronous on the CPU

  def evaluate(self) -> dict[str, float]:
    """Accuracy (per example, or per token) and mean cross-entropy over the eval set."""
    torch = self.torch
    correct = count = loss = 0.0
    self.model.eval()  # (BatchNorm's running statistics; DDP's are rank 0's, broadcast)
    with torch.no_grad():
      for inputs, labels, weights in self.data.eval_batches(self.size):
        logits = self.model(self._inputs(inputs)).double()
        if self.sequence:  # a weight per sequence, on each of its tokens
          weights = np.broadcast_to(weights[:, None], labels.shape)
        nll = -torch.log_softmax(logits, -1).gather(
            -1, torch.from_numpy(labels.astype(np.int64))[..., None])[..., 0].numpy()
        hit = (logits.argmax(-1).numpy() == labels).astype(np.float64)
        correct += float(np.sum(hit * weights))
        loss += float(np.sum(nll * weights))
        count += float(np.sum(weights))
    self.model.train()
    return {"accuracy": correct / count, "loss": loss / count}
