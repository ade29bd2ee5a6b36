"""Convolutions on one core, XLA:CPU against PyTorch: the CNN task's layers and its whole step.

  python -m benchmarks.conv [--batch 128] [--procs 3] [--calls 10]
      [--out benchmarks/results/bench_conv.json]

The CNN task (configs/tta_fmnist_resnet.py: ResNet-20 on Fashion-MNIST, 128 images a worker)
is the one task whose JAX step is not at parity with PyTorch's on this CPU. This measures where
the time goes and what XLA:CPU's options do about it:
- each 3x3 convolution shape of ResNet-20 at 28 px (stride 1 and 2): the forward pass, the
  gradient of the input ("dgrad") and of the kernel ("wgrad"), each alone (jitted `jax.vjp`
  against `torch.autograd.grad` of `conv2d`, channels-last, PyTorch's fastest layout here);
- the whole train step (forward, backward, SGD with momentum; BatchNorm in training mode) of
  ResNet-20 at each size of the task's progressive resizing (12, 22, 28 px): flax against
  studies/time_to_accuracy/torch_peer.py's twin;
- the whole step at 28 px under each XLA:CPU flag that could route convolutions elsewhere
  (oneDNN, XNNPACK, YNNPACK fusions) and fast math.
Each figure: min / median / max over `--procs` separate processes, pinned to one core with the
other idle, each the median of `--calls` calls after 3 warm-ups (XLA: one thread, no Eigen
thread pool; PyTorch: one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from sparsejax.bench import command_line, footer, json_path, python_module, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ONE_CORE = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
# (size, channels in, channels out, stride) of ResNet-20's 3x3 convolutions at 28 px
LAYERS = ((28, 16, 16, 1), (28, 16, 32, 2), (14, 32, 32, 1), (14, 32, 64, 2), (7, 64, 64, 1))
SIZES = (12, 22, 28)
FLAGS = {  # variant -> XLA_FLAGS beside ONE_CORE (the whole step at 28 px)
    "default": "",
    "onednn": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_custom_call=true",
    "onednn conv fusion": "--xla_cpu_experimental_onednn_fusion_type=individual_convolution",
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "xnn graph fusion": ("--xla_cpu_experimental_xnn_graph_fusion_mode="
                         "XNN_GRAPH_FUSION_MODE_GREEDY"),
    "ynn conv fusion": "--xla_cpu_experimental_ynn_fusion_type=individual_convolution,dot",
    "fast math": "--xla_cpu_enable_fast_math=true",
}


def _median_time(fn, calls: int) -> float:
  for _ in range(3):
    fn()
  times = []
  for _ in range(calls):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def jax_layers(batch: int, calls: int) -> dict[str, float]:
  import jax
  import numpy as np
  rng = np.random.default_rng(0)
  out = {}
  for size, cin, cout, stride in LAYERS:
    x = jax.numpy.asarray(rng.standard_normal((batch, size, size, cin)), jax.numpy.float32)
    w = jax.numpy.asarray(rng.standard_normal((3, 3, cin, cout)) * 0.1, jax.numpy.float32)
    def conv(x, w, stride=stride):
      return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                          dimension_numbers=("NHWC", "HWIO", "NHWC"))
    g = jax.numpy.ones_like(conv(x, w))
    parts = {"fwd": (jax.jit(conv), (x, w)),
             "dgrad": (jax.jit(lambda x, w, g: jax.vjp(lambda x: conv(x, w), x)[1](g)), (x, w, g)),
             "wgrad": (jax.jit(lambda x, w, g: jax.vjp(lambda w: conv(x, w), w)[1](g)), (x, w, g))}
    for part, (fn, args) in parts.items():
      out[f"{size}px {cin}->{cout} /{stride} {part}"] = _median_time(
          lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), calls)
  return out


def torch_layers(batch: int, calls: int) -> dict[str, float]:
  import numpy as np
  import torch
  f = torch.nn.functional
  rng = np.random.default_rng(0)
  out = {}
  for size, cin, cout, stride in LAYERS:
    x = torch.from_numpy(rng.standard_normal((batch, cin, size, size)).astype(np.float32))
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    w = torch.from_numpy((rng.standard_normal((cout, cin, 3, 3)) * 0.1).astype(np.float32))
    w.requires_grad_()
    def conv(x=x, w=w, stride=stride):
      return f.conv2d(x, w, stride=stride, padding=1)
    g = torch.ones_like(conv())
    parts = {"fwd": lambda conv=conv: conv(),
             "dgrad": lambda conv=conv, x=x, g=g: torch.autograd.grad(conv(), x, g),
             "wgrad": lambda conv=conv, w=w, g=g: torch.autograd.grad(conv(), w, g)}
    with torch.no_grad():
      fwd = _median_time(parts.pop("fwd"), calls)
    out[f"{size}px {cin}->{cout} /{stride} fwd"] = fwd
    for part, fn in parts.items():  # (each includes its forward: taken off)
      out[f"{size}px {cin}->{cout} /{stride} {part}"] = max(0.0, _median_time(fn, calls) - fwd)
  return out


def jax_steps(batch: int, calls: int, sizes) -> dict[str, float]:
  import jax
  import numpy as np
  import optax

  from sparsejax import models
  model = models.build("resnet20", num_classes=10)
  out = {}
  for size in sizes:
    rng = np.random.default_rng(size)
    x = jax.numpy.asarray(rng.standard_normal((batch, size, size, 1)), jax.numpy.float32)
    y = jax.numpy.asarray(rng.integers(0, 10, batch), jax.numpy.int32)
    v = model.init(jax.random.key(0), x)
    tx = optax.sgd(0.1, 0.9)
    def step(p, stats, opt, x, y, tx=tx):
      def loss(p):
        logits, new = model.apply({"params": p, "batch_stats": stats}, x, train=True,
                                  mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new
      (_, new), g = jax.value_and_grad(loss, has_aux=True)(p)
      u, opt = tx.update(g, opt, p)
      return optax.apply_updates(p, u), new["batch_stats"], opt
    step = jax.jit(step, donate_argnums=(0, 1, 2), static_argnames="tx")
    state = [v["params"], v["batch_stats"], tx.init(v["params"])]
    def call(state=state, step=step, x=x, y=y):
      state[:] = step(*state, x, y)
      jax.block_until_ready(state)
    out[f"{size}px"] = _median_time(call, calls)
  return out


def torch_steps(batch: int, calls: int, sizes) -> dict[str, float]:
  import numpy as np
  import torch

  from studies.time_to_accuracy.torch_peer import torch_resnet
  model = torch_resnet((3, 3, 3), 16, 10, 1, small_inputs=True)
  opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
  out = {}
  for size in sizes:
    rng = np.random.default_rng(size)
    x = torch.from_numpy(rng.standard_normal((batch, size, size, 1)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, batch))
    def call(x=x, y=y):
      loss = torch.nn.functional.cross_entropy(model(x), y)
      opt.zero_grad(set_to_none=True)
      loss.backward()
      opt.step()
    out[f"{size}px"] = _median_time(call, calls)
  return out


def worker(args) -> dict[str, float]:
  from sparsejax.bench import pin_to_core
  if args.runtime == "jax":
    import jax
    jax.devices()  # (XLA's threads started: pinned with the rest)
  pin_to_core(0)
  if args.runtime == "torch":
    import torch
    torch.set_num_threads(1)
  if args.part == "layers":
    return (jax_layers if args.runtime == "jax" else torch_layers)(args.batch, args.calls)
  sizes = SIZES if args.part == "steps" else (28,)
  return (jax_steps if args.runtime == "jax" else torch_steps)(args.batch, args.calls, sizes)


def _spawn(args, runtime: str, part: str, flags: str = "") -> list[dict[str, float]]:
  runs = []
  for _ in range(args.procs):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{ONE_CORE} {flags}".strip()}
    out = subprocess.run([*python_module(__file__), "--worker", runtime, part,
                          "--batch", str(args.batch), "--calls", str(args.calls)],
                         capture_output=True, text=True, timeout=900, env=env)
    if out.returncode:
      raise RuntimeError(f"{runtime} {part} {flags!r} failed:\n{out.stderr[-2000:]}")
    runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
  return runs


def _mmm(values: list[float], scale: float = 1e3, digits: int = 1) -> str:
  s = sorted(values)
  return f"{s[0] * scale:.{digits}f} / {statistics.median(s) * scale:.{digits}f} / " \
         f"{s[-1] * scale:.{digits}f}"


def table(results: dict) -> str:
  meta = results["meta"]
  lines = [f"# Convolutions on one core: XLA:CPU against PyTorch (ResNet-20, batch "
           f"{meta['batch']})", "",
           f"ms, min / median / max over {meta['procs']} processes (each the median of "
           f"{meta['calls']} calls); ratio: JAX's median over PyTorch's.", "",
           "## The whole train step at each size of the task's resizing", "",
           "| size | JAX | PyTorch | JAX / PyTorch |", "|---|---|---|---|"]
  for key in results["steps"]["jax"][0]:
    j = [r[key] for r in results["steps"]["jax"]]
    t = [r[key] for r in results["steps"]["torch"]]
    lines.append(f"| {key} | {_mmm(j)} | {_mmm(t)} | "
                 f"{statistics.median(j) / statistics.median(t):.2f} |")
  lines += ["", "## Each 3x3 convolution of the 28 px stage", "",
            "| layer | part | JAX | PyTorch | JAX / PyTorch |", "|---|---|---|---|---|"]
  for key in results["layers"]["jax"][0]:
    j = [r[key] for r in results["layers"]["jax"]]
    t = [r[key] for r in results["layers"]["torch"]]
    layer, _, part = key.rpartition(" ")
    ratio = statistics.median(j) / statistics.median(t) if statistics.median(t) else float("inf")
    lines.append(f"| {layer} | {part} | {_mmm(j, digits=2)} | {_mmm(t, digits=2)} | "
                 f"{ratio:.2f} |")
  torch28 = statistics.median(r["28px"] for r in results["steps"]["torch"])
  lines += ["", "## XLA:CPU's options, the whole step at 28 px", "",
            "| variant | XLA_FLAGS | JAX | over PyTorch's step |", "|---|---|---|---|"]
  for name, runs in results["flags"].items():
    j = [r["28px"] for r in runs]
    lines.append(f"| {name} | `{FLAGS[name] or '-'}` | {_mmm(j)} | "
                 f"{statistics.median(j) / torch28:.2f} |")
  return "\n".join(lines + ["", footer(meta)])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--procs", type=int, default=3)
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--out", type=json_path,
                  default=os.path.join(HERE, "results", "bench_conv.json"))
  ap.add_argument("--worker", nargs=2, metavar=("RUNTIME", "PART"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.batch < 1 or args.procs < 1 or args.calls < 1:
    ap.error(f"--batch, --procs and --calls must be >= 1, got {args.batch}, {args.procs}, "
             f"{args.calls}")
  if args.worker:
    args.runtime, args.part = args.worker
    print(json.dumps(worker(args)))
    return 0
  command = command_line("benchmarks/conv.py", sys.argv[1:] if argv is None else argv)
  meta = {"batch": args.batch, "procs": args.procs, "calls": args.calls,
          "machine": platform.machine(), "cpus": os.cpu_count(),
          "date": time.strftime("%Y-%m-%d"), "command": command}
  results = {"meta": meta,
             "steps": {rt: _spawn(args, rt, "steps") for rt in ("jax", "torch")},
             "layers": {rt: _spawn(args, rt, "layers") for rt in ("jax", "torch")},
             "flags": {name: _spawn(args, "jax", "step28", flags)
                       for name, flags in FLAGS.items()}}
  text = table(results)
  write_results(args.out, results, text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
