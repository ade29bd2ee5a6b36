"""`sparsejax` command line: thin, it parses and calls the library.

  sparsejax train CONFIG [--workdir DIR] [--set key=value ...]
  sparsejax launch --nodes N|MIN:MAX --procs-per-node P [--devices-per-proc D] \
      [--bandwidth RATE] [--max-restarts K] [--heartbeat-timeout S] -- train CONFIG [...]
  sparsejax prepare imagenet --manual-dir DIR --data-dir DIR [--fake]
  sparsejax prepare wmt14 --data-dir DIR
  sparsejax info [--config CONFIG]
"""

from __future__ import annotations

import argparse
import os
import sys


def _ensure_cpu_devices(wanted: int) -> None:
  """On a CPU-only machine, asks XLA for `wanted` virtual devices. XLA reads the flag when the
  first backend starts (not when jax is imported), so this must run before any device query."""
  if wanted <= 1:
    return
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    return
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" in flags:
    return
  try:  # a GPU/TPU machine keeps its real devices
    import importlib.util
    if importlib.util.find_spec("jax_cuda12_plugin") or importlib.util.find_spec("libtpu"):
      return
  except (ImportError, ValueError):
    pass
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={wanted}".strip()


def _train(args: argparse.Namespace) -> int:
  from sparsejax.train import config as config_lib

  try:
    raw = config_lib.load_config(args.config)
    config = config_lib.validate(config_lib.apply_overrides(raw, args.set or []))
  except ValueError as e:
    print(f"sparsejax train: {e}", file=sys.stderr)
    return 2
  from sparsejax import cluster
  try:
    distributed = cluster.initialize()  # one of several processes (sparsejax launch, SLURM)?
  except Exception as e:  # noqa: BLE001 - jax raises various errors when peers are unreachable
    print(f"sparsejax train: cannot start jax.distributed: {e}", file=sys.stderr)
    return 4
  if not distributed:  # a pipelined exchange on two devices per worker: twice the devices
    _ensure_cpu_devices(config.mesh.num_devices * (
        2 if config.overlap.pipeline == "device" else 1))
  from sparsejax.train import CheckpointError, TooManySkippedSteps, train_and_evaluate

  workdir = args.workdir or os.path.join(
      "runs", os.path.splitext(os.path.basename(args.config))[0])
  try:
    summary = train_and_evaluate(config, workdir, progress=not args.no_progress)
  except ValueError as e:
    print(f"sparsejax train: {e}", file=sys.stderr)
    return 2
  except TooManySkippedSteps as e:
    print(f"sparsejax train: {e}", file=sys.stderr)
    return 3
  except CheckpointError as e:  # every checkpoint in the workdir is damaged
    print(f"sparsejax train: {e}", file=sys.stderr)
    return 5
  import jax
  if jax.process_index() == 0:
    _print_summary(summary, workdir)
  # stopped early with a checkpoint saved: 128 + the signal, as a shell reports it
  return {"SIGINT": 130, "SIGTERM": 143}.get(summary.get("interrupted_by"), 0)


def _print_summary(summary: dict, workdir: str) -> None:
  rows = [("steps", f"{summary['steps']} / {summary['total_steps']}"),
          ("wall time", f"{summary['wall_time_s']:.1f} s"),
          ("MB sent per worker", f"{summary['bytes_sent'] / 1e6:.1f}"),
          ("skipped steps", str(summary["skipped_steps"]))]
  target = (summary.get("config") or {}).get("target_metric")
  reached = summary.get("time_to_target")
  if reached:  # the DAWNBench figure: the run's wall time when the target was first reached
    op = "<=" if reached["metric"] == "loss" else ">="
    rows.append(("time to target", f"{reached['wall_time_s']:.1f} s (step {reached['step']}: "
                 f"{reached['metric']} {reached['value']:.4f} {op} {reached['target']})"))
  elif target:
    rows.append(("time to target", f"not reached ({target} "
                 f"{summary['config'].get('target_value')})"))
  for name, block in (("final", summary.get("final_eval")), ("best", summary.get("best_eval"))):
    for k, v in (block or {}).items():
      rows.append((f"{name} {k}", f"{v:.4f}" if isinstance(v, float) else str(v)))
  width = max(len(r[0]) for r in rows)
  print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
  print(f"workdir: {os.path.abspath(workdir)} (train.csv, eval.csv, tensorboard/, checkpoints/, "
        "summary.json)")


def _check_distributed(repeat: int = 1) -> int:
  """Every process adds its rank over all devices of all processes (`repeat` times, reporting the
  median time): a cluster connectivity and latency check."""
  import statistics
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("all",))
  sharding = NamedSharding(mesh, P("all"))
  local = np.full((jax.local_device_count(),), jax.process_index() + 1, np.float32)
  x = jax.make_array_from_process_local_data(sharding, local)
  reduce = jax.jit(lambda v: jnp.sum(v), out_shardings=NamedSharding(mesh, P()))
  expect = sum((p + 1) * jax.local_device_count() for p in range(jax.process_count()))
  got = float(np.asarray(reduce(x)))
  print(f"all-reduce over {jax.device_count()} devices of {jax.process_count()} processes: "
        f"{got:g} (expected {expect:g})", flush=True)
  times = []
  for _ in range(repeat - 1):
    t0 = time.perf_counter()
    jax.block_until_ready(reduce(x))
    times.append(time.perf_counter() - t0)
  if times:
    print(f"{len(times)} more all-reduces: median {1e3 * statistics.median(times):.2f} ms")
  return 0 if got == expect else 1


def _info(args: argparse.Namespace) -> int:
  mesh_sizes = (1, -1)
  if args.distributed:
    from sparsejax import cluster
    try:
      cluster.initialize()
    except Exception as e:  # noqa: BLE001
      print(f"sparsejax info: cannot start jax.distributed: {e}", file=sys.stderr)
      return 4
  if args.config:
    from sparsejax.train import config as config_lib
    try:
      config = config_lib.validate(config_lib.load_config(args.config))
    except ValueError as e:
      print(f"sparsejax info: {e}", file=sys.stderr)
      return 2
    _ensure_cpu_devices(config.mesh.num_devices)
    mesh_sizes = (config.mesh.nodes, config.mesh.local)
  import flax
  import jax
  import optax

  import sparsejax
  print(f"sparsejax {sparsejax.__version__}, jax {jax.__version__}, flax {flax.__version__}, "
        f"optax {optax.__version__}")
  print(f"backend: {jax.default_backend()}, processes: {jax.process_count()}, "
        f"devices: {jax.device_count()} ({jax.local_device_count()} local)")
  for d in jax.local_devices():
    print(f"  {d.id}: {d.device_kind}")
  from sparsejax.train.mesh import make_mesh
  try:
    mesh = make_mesh(*mesh_sizes)
  except ValueError as e:
    print(f"mesh: {e}")
    return 2
  print(f"mesh: node x local = {mesh.shape['node']} x {mesh.shape['local']}"
        + (f" (from {args.config})" if args.config else " (default: one node)"))
  return _check_distributed(args.repeat) if args.distributed else 0


def _launch(args: argparse.Namespace) -> int:
  from sparsejax import cluster
  command = args.command_args[1:] if args.command_args[:1] == ["--"] else args.command_args
  try:
    min_nodes, nodes = cluster.parse_nodes(args.nodes)
    return cluster.launch(command, nodes=nodes, min_nodes=min_nodes,
                          procs_per_node=args.procs_per_node,
                          devices_per_proc=args.devices_per_proc, bandwidth=args.bandwidth,
                          init_timeout_s=args.init_timeout, max_restarts=args.max_restarts,
                          heartbeat_timeout_s=args.heartbeat_timeout or None)
  except (ValueError, PermissionError, RuntimeError) as e:
    print(f"sparsejax launch: {e}", file=sys.stderr)
    return 2


def _prepare(args: argparse.Namespace) -> int:
  from sparsejax.data import imagenet, translation
  if args.dataset == "wmt14":
    try:
      builder = translation.prepare_wmt14(args.data_dir)
    except ModuleNotFoundError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    return _prepared(builder, args.data_dir)
  if not args.manual_dir:
    print("error: prepare imagenet needs --manual-dir (the directory holding "
          "ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar)", file=sys.stderr)
    return 2
  try:
    if args.fake:
      info = imagenet.fake_manual_dir(args.manual_dir, classes=args.fake_classes,
                                      per_class=args.fake_per_class, val=args.fake_val)
      print(f"wrote a fake manual download to {args.manual_dir}: {info['train']} train, "
            f"{info['val']} validation images ({len(info['corrupt'])} corrupt)")
    builder = imagenet.prepare(args.manual_dir, args.data_dir)
  except (FileNotFoundError, ModuleNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return _prepared(builder, args.data_dir)


def _prepared(builder, data_dir: str) -> int:
  splits = {k: v.num_examples for k, v in builder.info.splits.items()}
  print(f"{builder.info.full_name} prepared under {data_dir}: {splits}; train with "
        f"--set data.path={data_dir}")
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="sparsejax", description=__doc__.split("\n")[0])
  sub = parser.add_subparsers(dest="command", required=True)
  t = sub.add_parser("train", help="train an experiment config")
  t.add_argument("config", help="a Python file with get_config()")
  t.add_argument("--workdir", help="where metrics, checkpoints and summary.json go "
                                   "(default runs/<config name>)")
  t.add_argument("--set", action="append", metavar="KEY=VALUE",
                 help="override a config key, e.g. --set optimizer.learning_rate=0.1")
  t.add_argument("--no-progress", action="store_true", help="no progress bar")
  t.set_defaults(func=_train)
  i = sub.add_parser("info", help="devices, mesh and versions")
  i.add_argument("--config", help="show the mesh this config would build")
  i.add_argument("--distributed", action="store_true",
                 help="join the processes of `sparsejax launch` (or SLURM/MPI) and all-reduce "
                      "across them: a connectivity check")
  i.add_argument("--repeat", type=int, default=1, help="with --distributed: all-reduces to time")
  i.set_defaults(func=_info)
  la = sub.add_parser("launch", help="run a command as several processes on this machine, "
                                     "optionally inside an emulated cluster")
  la.add_argument("--nodes", required=True, metavar="N|MIN:MAX",
                  help="emulated nodes (>= 1); MIN:MAX starts on MAX and, when a node is lost, "
                       "starts again on the nodes left while at least MIN remain")
  la.add_argument("--max-restarts", type=int, default=3,
                  help="with --nodes MIN:MAX: the most restarts after lost nodes")
  la.add_argument("--heartbeat-timeout", type=int, default=3, metavar="S",
                  help="a process silent for S seconds is dead to the others, which then abort "
                       "(0: JAX's default, 100 s)")
  la.add_argument("--procs-per-node", type=int, default=1, help="processes per node (>= 1)")
  la.add_argument("--devices-per-proc", type=int, default=1,
                  help="virtual CPU devices per process (>= 1)")
  la.add_argument("--bandwidth", help="limit each node's link, e.g. 1gbit or 200mbit (needs "
                                      "root: namespaces, veths, tc)")
  la.add_argument("--init-timeout", type=int, default=120,
                  help="seconds a process waits for the others at start-up")
  la.add_argument("command_args", nargs=argparse.REMAINDER,
                  help="after --: the sparsejax command each process runs, e.g. train CONFIG")
  la.set_defaults(func=_launch)
  p = sub.add_parser("prepare", help="prepare a dataset (ImageNet or WMT14 en-de via TFDS) for "
                                      "training")
  p.add_argument("dataset", choices=["imagenet", "wmt14"])
  p.add_argument("--manual-dir",
                 help="imagenet: holds ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar "
                      "(wmt14 downloads its files)")
  p.add_argument("--data-dir", required=True, help="the TFDS data directory to write")
  p.add_argument("--fake", action="store_true",
                 help="first write a small generated manual download (for smoke runs)")
  p.add_argument("--fake-classes", type=int, default=4)
  p.add_argument("--fake-per-class", type=int, default=8)
  p.add_argument("--fake-val", type=int, default=16)
  p.set_defaults(func=_prepare)
  args = parser.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
