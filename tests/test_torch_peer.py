"""studies/time_to_accuracy/torch_peer.py: the PyTorch Transformer LM and ResNet are
sparsejax's (same parameters give the same logits and gradients; the same initialisation), and
its AdamW and LARS are optax's with the trainer's decay mask."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparsejax import models
from sparsejax.train.optimizer import decay_mask
from studies.time_to_accuracy import torch_peer

# end to end (the emulated cluster, the studies, whole recipes): `python -m pytest -m integration`
pytestmark = pytest.mark.integration

torch = pytest.importorskip("torch", reason="needs PyTorch: pip install -e '.[peers]' "
                            "torch==2.13.0")

VOCAB, D, HEADS, FF, LAYERS, LEN = 37, 24, 3, 40, 2, 11


def _flax_lm():
  model = models.build("transformer_lm", num_classes=VOCAB, d_model=D, num_heads=HEADS, d_ff=FF,
                       num_layers=LAYERS, dropout=0.0, max_len=LEN)
  tokens = np.random.default_rng(1).integers(1, VOCAB, (5, LEN - 2)).astype(np.int32)
  # (jitted: one compile, not one per operation and shape, as eagerly; the same values)
  init = jax.jit(functools.partial(model.init, train=False))
  return model, init(jax.random.key(3), tokens)["params"], tokens


def _t(x) -> "torch.Tensor":
  return torch.from_numpy(np.array(x, np.float32))


def _copy_into(peer, params) -> None:
  """flax's parameters into the PyTorch twin (kernels transposed, heads flattened)."""
  with torch.no_grad():
    peer.embedding.copy_(_t(params["embed"]["embedding"]))
    peer.positions.copy_(_t(params["embed"]["positions"]))
    for i, layer in enumerate(peer.layers):
      p = params["decoder"][f"layer{i}"]
      for ln in ("ln_self", "ln_mlp"):
        getattr(layer, ln).weight.copy_(_t(p[ln]["scale"]))
        getattr(layer, ln).bias.copy_(_t(p[ln]["bias"]))
      for name, lin in (("query", layer.q), ("key", layer.k), ("value", layer.v)):
        lin.weight.copy_(_t(p["self_attn"][name]["kernel"].reshape(D, D).T))
        lin.bias.copy_(_t(p["self_attn"][name]["bias"].reshape(D)))
      layer.o.weight.copy_(_t(p["self_attn"]["out"]["kernel"].reshape(D, D).T))
      layer.o.bias.copy_(_t(p["self_attn"]["out"]["bias"]))
      for name in ("wi", "wo"):
        getattr(layer, name).weight.copy_(_t(p[name]["kernel"].T))
        getattr(layer, name).bias.copy_(_t(p[name]["bias"]))
    peer.ln_final.weight.copy_(_t(params["decoder"]["ln_final"]["scale"]))
    peer.ln_final.bias.copy_(_t(params["decoder"]["ln_final"]["bias"]))


def test_the_pytorch_transformer_is_the_flax_one_forward_and_backward():
  model, params, tokens = _flax_lm()
  peer = torch_peer.torch_transformer_lm(VOCAB, D, HEADS, FF, LAYERS, LEN)
  assert sum(p.numel() for p in peer.parameters()) == sum(
      v.size for v in jax.tree.leaves(params))
  _copy_into(peer, params)
  labels = np.roll(tokens, -1, axis=1)
  got = peer(torch.from_numpy(tokens.astype(np.int64)))
  want = jax.jit(functools.partial(model.apply, train=False))({"params": params}, tokens)
  np.testing.assert_allclose(got.detach().numpy(), np.asarray(want), rtol=2e-4, atol=2e-5)

  def loss_fn(p):
    logits = model.apply({"params": p}, tokens, train=False)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  grads = jax.jit(jax.grad(loss_fn))(params)
  torch.nn.functional.cross_entropy(got.reshape(-1, VOCAB),
                                    torch.from_numpy(labels.astype(np.int64)).reshape(-1)
                                    ).backward()
  np.testing.assert_allclose(peer.embedding.grad.numpy(), grads["embed"]["embedding"],
                             rtol=1e-3, atol=1e-6)
  np.testing.assert_allclose(peer.layers[0].q.weight.grad.numpy(),
                             grads["decoder"]["layer0"]["self_attn"]["query"]["kernel"]
                             .reshape(D, D).T, rtol=1e-3, atol=1e-6)
  np.testing.assert_allclose(peer.ln_final.weight.grad.numpy(),
                             grads["decoder"]["ln_final"]["scale"], rtol=1e-3, atol=1e-6)


def test_the_pytorch_transformer_starts_where_flax_does():
  """The same initial distributions: embedding std d^-1/2, positions 0.02, kernels
  1/sqrt(fan_in), biases zero, LayerNorm scale one."""
  d = 256
  peer = torch_peer.torch_transformer_lm(1000, d, 4, 1024, 1, 64)
  model = models.build("transformer_lm", num_classes=1000, d_model=d, num_heads=4, d_ff=1024,
                       num_layers=1, dropout=0.0, max_len=64)
  params = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(0), np.ones((1, 8), np.int32))["params"]
  layer = params["decoder"]["layer0"]
  pairs = [(peer.embedding, params["embed"]["embedding"], d ** -0.5),
           (peer.positions, params["embed"]["positions"], 0.02),
           (peer.layers[0].q.weight, layer["self_attn"]["query"]["kernel"], d ** -0.5),
           (peer.layers[0].wo.weight, layer["wo"]["kernel"], 1024 ** -0.5)]
  for theirs, ours, std in pairs:
    assert abs(float(theirs.detach().std()) / std - 1) < 0.05
    assert abs(float(np.std(np.asarray(ours))) / std - 1) < 0.05
  assert float(peer.layers[0].wi.bias.detach().abs().max()) == 0.0
  assert float(peer.layers[0].ln_self.weight.detach().min()) == 1.0


def _same_three_steps(o, make_tx, seed: int, lrs, kernel_shape) -> Any:
  """Three steps of the peer's optimizer for `o` and of optax's (`make_tx(schedule)`, masked by
  the trainer's `decay_mask`) from the same parameters on the same fresh gradients, the learning
  rate changing each step; asserts they agree and returns the peer's module."""
  rng = np.random.default_rng(seed)
  params = {"kernel": rng.standard_normal(kernel_shape).astype(np.float32),
            "bias": rng.standard_normal(kernel_shape[-1]).astype(np.float32)}
  module = torch.nn.Module()
  module.kernel = torch.nn.Parameter(torch.from_numpy(params["kernel"].copy()))
  module.bias = torch.nn.Parameter(torch.from_numpy(params["bias"].copy()))
  opt = torch_peer.build_optimizer(torch, module, o)
  step = iter(lrs)
  tx = make_tx(lambda _: next(step))
  state = tx.init(params)
  for lr in lrs:
    grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    for group in opt.param_groups:
      group["lr"] = lr
    module.kernel.grad, module.bias.grad = (torch.from_numpy(grads["kernel"]),
                                            torch.from_numpy(grads["bias"]))
    opt.step()
  np.testing.assert_allclose(module.kernel.detach().numpy(), params["kernel"], rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(module.bias.detach().numpy(), params["bias"], rtol=1e-5, atol=1e-6)
  return module


def test_the_pytorch_adamw_is_optax_adamw_with_the_decay_mask():
  """Three steps of torch's AdamW (decay on parameters of 2+ dimensions) equal optax.adamw
  masked by the trainer's `decay_mask`, on fresh gradients, with a changing learning rate."""
  lrs = [1e-2, 3e-3, 5e-4]
  o = type("O", (), {"name": "adamw", "learning_rate": lrs[0], "b1": 0.9, "b2": 0.98,
                     "eps": 1e-8, "weight_decay": 0.1})()
  _same_three_steps(o, lambda lr: optax.adamw(lr, b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.1,
                                              mask=decay_mask), 7, lrs, (7, 5))


def test_the_peer_refuses_what_it_cannot_build():
  cfg = type("C", (), {})()
  cfg.model = type("M", (), {"name": "resnet50", "dropout": 0.0})()
  with pytest.raises(ValueError, match="'resnet20', got 'resnet50'"):
    torch_peer.build_model(cfg, None)
  cfg.model = type("M", (), {"name": "transformer_lm", "dropout": 0.1})()
  with pytest.raises(ValueError, match="model.dropout=0.0"):
    torch_peer.build_model(cfg, None)
  o = type("O", (), {"name": "lamb"})()
  with pytest.raises(ValueError, match="'adamw' and 'lars', got 'lamb'"):
    torch_peer.build_optimizer(torch, torch.nn.Linear(2, 2), o)


def _copy_resnet(peer, params, stats) -> None:
  """flax's ResNet parameters and BatchNorm statistics into the PyTorch twin (kernels HWIO to
  OIHW)."""
  def conv(t, p):
    t.weight.copy_(_t(np.asarray(p["kernel"]).transpose(3, 2, 0, 1)))

  def bn(t, p, s):
    t.weight.copy_(_t(p["scale"]))
    t.bias.copy_(_t(p["bias"]))
    t.running_mean.copy_(_t(s["mean"]))
    t.running_var.copy_(_t(s["var"]))
  blocks = sorted((k for k in params if k.startswith("ResNetBlock_")),
                  key=lambda k: int(k.split("_")[1]))
  assert len(blocks) == len(peer.blocks)
  with torch.no_grad():
    conv(peer.stem[0], params["conv_init"])
    bn(peer.stem[1], params["bn_init"], stats["bn_init"])
    for name, block in zip(blocks, peer.blocks):
      p, s = params[name], stats[name]
      conv(block.conv1, p["Conv_0"])
      bn(block.bn1, p["BatchNorm_0"], s["BatchNorm_0"])
      conv(block.conv2, p["Conv_1"])
      bn(block.bn2, p["BatchNorm_1"], s["BatchNorm_1"])
      assert ("proj_conv" in p) == (block.proj is not None), name
      if block.proj is not None:
        conv(block.proj[0], p["proj_conv"])
        bn(block.proj[1], p["proj_bn"], s["proj_bn"])
    peer.head.weight.copy_(_t(np.asarray(params["head"]["kernel"]).T))
    peer.head.bias.copy_(_t(params["head"]["bias"]))


@pytest.mark.parametrize("name, size, stem", [
    ("resnet20", 23, True),
    pytest.param("resnet18", 29, False, marks=pytest.mark.slow),  # (CI's budget: 20 s)
    ("resnet18", 32, False)])
def test_the_pytorch_resnet_is_the_flax_one_in_training_and_in_evaluation(name, size, stem):
  """Random parameters (BatchNorm's scales too: flax starts each block's last at 0) and
  statistics: the same logits in training (batch statistics) and in evaluation (running ones),
  the same gradient of the input, and the same running statistics after a training step, at an
  odd image size (flax's SAME padding puts the odd pixel low or high by size and stride)."""
  kwargs = {"num_filters": 8} if name == "resnet18" else {}
  model = models.build(name, num_classes=7, **kwargs)
  rng = np.random.default_rng(2)
  x = rng.standard_normal((5, size, size, 2)).astype(np.float32)
  # (jitted, with an RBG key, and the perturbation drawn by numpy: eager jax.random compiles a
  # program per operation and shape, ~35 s of this test's 45 on 2 cores)
  variables = jax.jit(functools.partial(model.init, train=False))(
      jax.random.key(0, impl="rbg"), x)
  params = jax.tree.map(lambda a: np.asarray(a) + 0.2 * rng.standard_normal(a.shape, np.float32),
                        variables["params"])
  stats = jax.tree.map(lambda a: np.asarray(a) + 0.1 * rng.random(a.shape, np.float32),
                       variables["batch_stats"])
  peer = torch_peer.torch_resnet(tuple(models.MODELS[name].keywords["stage_sizes"]),
                                 kwargs.get("num_filters", 16), 7, 2, small_inputs=stem)
  assert sum(p.numel() for p in peer.parameters()) == sum(
      v.size for v in jax.tree.leaves(params))
  _copy_resnet(peer, params, stats)
  peer.eval()
  np.testing.assert_allclose(peer(_t(x)).detach().numpy(), np.asarray(jax.jit(functools.partial(
      model.apply, train=False))({"params": params, "batch_stats": stats}, x)), rtol=1e-4,
      atol=1e-4)
  peer.train()
  xt = _t(x).requires_grad_()
  logits = peer(xt)
  (logits ** 2).sum().backward()
  def loss(x):
    out, new = model.apply({"params": params, "batch_stats": stats}, x, train=True,
                           mutable=["batch_stats"])
    return (out ** 2).sum(), (out, new)
  (_, (out, new)), dx = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
  np.testing.assert_allclose(logits.detach().numpy(), np.asarray(out), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(xt.grad.numpy(), np.asarray(dx), rtol=1e-3, atol=1e-4)
  # running statistics moved the same way (torch's variance is unbiased: n / (n - 1) apart)
  n = 5 * (size if stem else -(-size // 2)) ** 2
  first = (peer.stem[1], new["batch_stats"]["bn_init"])
  np.testing.assert_allclose(first[0].running_mean.numpy(), np.asarray(first[1]["mean"]),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(first[0].running_var.numpy(), np.asarray(
      stats["bn_init"]["var"]) * 0.9 + (np.asarray(first[1]["var"]) - 0.9 * np.asarray(
          stats["bn_init"]["var"])) * n / (n - 1), rtol=1e-4, atol=1e-5)


def test_the_pytorch_lars_is_optax_lars_with_the_trainer_masks():
  """Three steps of the peer's LARS (decay and trust ratio on parameters of 2+ dimensions)
  equal optax.lars masked by the trainer's `decay_mask`, on fresh gradients, with a changing
  learning rate; and Nesterov, which it lacks, is refused."""
  lrs = [2.0, 0.7, 0.3]
  o = type("O", (), {"name": "lars", "learning_rate": lrs[0], "momentum": 0.9,
                     "trust_coefficient": 0.01, "weight_decay": 0.05, "nesterov": False})()
  module = _same_three_steps(o, lambda lr: optax.lars(
      lr, weight_decay=0.05, weight_decay_mask=decay_mask, trust_coefficient=0.01,
      trust_ratio_mask=decay_mask, momentum=0.9), 11, lrs, (9, 4, 3))
  o.nesterov = True
  with pytest.raises(ValueError, match="optimizer.nesterov=False"):
    torch_peer.build_optimizer(torch, module, o)
