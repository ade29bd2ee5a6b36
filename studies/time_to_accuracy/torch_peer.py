"""The PyTorch DDP peer of the time-to-accuracy study: the task's model built in PyTorch with
flax's initialisation, the same batches, schedule, optimizer and weight-decay rule.

Models: `mlp` (`torch_mlp`, `sparsejax.models.MLP`) and `transformer_lm` (`TorchTransformerLM`,
`sparsejax.models.TransformerLM`: learned positions, pre-LN, the output projection tied to the
token embedding). Optimizers: SGD (momentum, Nesterov) and AdamW (decoupled decay, as optax's
`adamw`), decay on kernels only (`p.dim() > 1`, the trainer's `decay_mask`).
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


def build_model(config, data):
  """The PyTorch twin of the config's model (`mlp` or `transformer_lm`)."""
  m = config.model
  if m.name == "mlp":
    in_dim = int(np.prod(data.example(None).shape[1:]))
    return torch_mlp(in_dim, tuple(m.hidden) or (1024, 1024), data.num_classes)
  if m.name == "transformer_lm":
    if m.dropout > 0:
      raise ValueError(f"the PyTorch peer's Transformer has no dropout; set model.dropout=0.0 "
                       f"(got {m.dropout})")
    return torch_transformer_lm(data.num_classes, m.d_model, m.num_heads, m.d_ff, m.num_layers,
                                config.data.seq_len)
  raise ValueError(f"the PyTorch peer builds models 'mlp' and 'transformer_lm', got {m.name!r}")


def build_optimizer(torch, model, o):
  """SGD or AdamW of the config's `optimizer` group, decay on kernels only."""
  if o.name not in ("sgd", "adamw"):
    raise ValueError(f"the PyTorch peer runs optimizers 'sgd' and 'adamw', got {o.name!r}")
  decay = [p for p in model.parameters() if p.dim() > 1]
  rest = [p for p in model.parameters() if p.dim() <= 1]
  groups = [{"params": decay, "weight_decay": o.weight_decay},
            {"params": rest, "weight_decay": 0.0}]
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
    from sparsejax.train import schedules
    torch.set_num_threads(1)
    torch.manual_seed(config.seed)
    self.torch, self.rank, self.world = torch, rank, world
    self.data = data_lib.open_inputs(config)
    self.sequence = config.model.name == "transformer_lm"
    self.total = max(1, math.ceil(config.num_epochs * self.data.steps_per_epoch))
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
    lr = schedules.learning_rate(config.optimizer, self.data.steps_per_epoch, self.total)
    self.lrs = [float(lr(s)) for s in range(self.total)]

  def _inputs(self, x: np.ndarray):
    x = np.ascontiguousarray(x)
    if self.sequence:
      return self.torch.from_numpy(x.astype(np.int64))
    return self.torch.from_numpy(x.reshape(len(x), -1))

  def _loss(self, logits, labels):
    f = self.torch.nn.functional
    if self.sequence:
      return f.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return f.cross_entropy(logits, labels)

  def step(self, step: int, wait: bool = True, level_step: int | None = None) -> float:
    del level_step  # dense: one level
    images, labels = self.data.train_batch(step, None)
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

  def wait(self) -> None:
    pass  # every PyTorch step is synchronous on the CPU

  def evaluate(self) -> dict[str, float]:
    """Accuracy (per example, or per token) and mean cross-entropy over the eval set."""
    torch = self.torch
    correct = count = loss = 0.0
    with torch.no_grad():
      for inputs, labels, weights in self.data.eval_batches(None):
        logits = self.model(self._inputs(inputs)).double()
        if self.sequence:  # a weight per sequence, on each of its tokens
          weights = np.broadcast_to(weights[:, None], labels.shape)
        nll = -torch.log_softmax(logits, -1).gather(
            -1, torch.from_numpy(labels.astype(np.int64))[..., None])[..., 0].numpy()
        hit = (logits.argmax(-1).numpy() == labels).astype(np.float64)
        correct += float(np.sum(hit * weights))
        loss += float(np.sum(nll * weights))
        count += float(np.sum(weights))
    return {"accuracy": correct / count, "loss": loss / count}
