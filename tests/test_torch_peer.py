"""studies/time_to_accuracy/torch_peer.py: the PyTorch Transformer LM is sparsejax's (same
parameters give the same logits and gradients; the same initialisation), and its AdamW is optax's
with the trainer's decay mask."""

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
  return model, model.init(jax.random.key(3), tokens, train=False)["params"], tokens


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
  want = model.apply({"params": params}, tokens, train=False)
  np.testing.assert_allclose(got.detach().numpy(), np.asarray(want), rtol=2e-4, atol=2e-5)

  def loss_fn(p):
    logits = model.apply({"params": p}, tokens, train=False)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
  grads = jax.grad(loss_fn)(params)
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
  params = model.init(jax.random.key(0), np.ones((1, 8), np.int32), train=False)["params"]
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


def test_the_pytorch_adamw_is_optax_adamw_with_the_decay_mask():
  """Three steps of torch's AdamW (decay on parameters of 2+ dimensions) equal optax.adamw
  masked by the trainer's `decay_mask`, on fresh gradients, with a changing learning rate."""
  rng = np.random.default_rng(7)
  params = {"kernel": rng.standard_normal((7, 5)).astype(np.float32),
            "bias": rng.standard_normal(5).astype(np.float32)}
  lrs = [1e-2, 3e-3, 5e-4]
  o = type("O", (), {"name": "adamw", "learning_rate": lrs[0], "b1": 0.9, "b2": 0.98,
                     "eps": 1e-8, "weight_decay": 0.1})()
  module = torch.nn.Module()
  module.kernel = torch.nn.Parameter(torch.from_numpy(params["kernel"].copy()))
  module.bias = torch.nn.Parameter(torch.from_numpy(params["bias"].copy()))
  opt = torch_peer.build_optimizer(torch, module, o)
  step = iter(lrs)
  tx = optax.adamw(lambda _: next(step), b1=0.9, b2=0.98, eps=1e-8, weight_decay=0.1,
                   mask=decay_mask)
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


def test_the_peer_refuses_what_it_cannot_build():
  cfg = type("C", (), {})()
  cfg.model = type("M", (), {"name": "resnet50", "dropout": 0.0})()
  with pytest.raises(ValueError, match="'mlp' and 'transformer_lm', got 'resnet50'"):
    torch_peer.build_model(cfg, None)
  cfg.model = type("M", (), {"name": "transformer_lm", "dropout": 0.1})()
  with pytest.raises(ValueError, match="model.dropout=0.0"):
    torch_peer.build_model(cfg, None)
  o = type("O", (), {"name": "lamb"})()
  with pytest.raises(ValueError, match="'sgd' and 'adamw', got 'lamb'"):
    torch_peer.build_optimizer(torch, torch.nn.Linear(2, 2), o)
