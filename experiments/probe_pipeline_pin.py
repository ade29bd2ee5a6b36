"""Probe: does pinning a node process to one core before XLA starts serialise the pipelined
exchange? One emulated node per process (a namespace each, root), two CPU devices each; rank 0
prints the pipelined step's halves alone, their timeline together and five steady steps (ms):

  python experiments/probe_pipeline_pin.py --rate 200mbit --pin after     # every thread, once
                                                                          # XLA has started
  python experiments/probe_pipeline_pin.py --rate 200mbit --pin before    # before XLA starts
  python experiments/probe_pipeline_pin.py --rate 200mbit --pin after --unpipelined  # 1 device
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str]) -> int:
  """The driver: two emulated nodes at `--rate`, this file as each node's process."""
  import argparse

  from sparsejax import cluster
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rate", default="200mbit", help='"unlimited" or a tc rate (200mbit)')
  ap.add_argument("--pin", default="after", choices=("after", "before"),
                  help="each node's process pinned to its core after XLA starts (every "
                  "thread) or before (the process, then XLA sizes its pool to one core)")
  ap.add_argument("--unpipelined", action="store_true", help="one device, no pipeline")
  args = ap.parse_args(argv)
  env = {"PIN_AFTER": str(int(args.pin == "after")),
         "PIPE": "" if args.unpipelined else "device", "GLOO_SOCKET_IFNAME": "eth0"}
  rate = None if args.rate == "unlimited" else cluster.parse_rate(args.rate)
  with cluster.EmulatedCluster(2, rate) as c:  # a namespace per node at every rate
    return cluster.launch([os.path.abspath(__file__)], nodes=2, procs_per_node=1,
                          devices_per_proc=1 if args.unpipelined else 2,
                          program=[sys.executable], extra_env=env, cluster=c)


if "SPARSEJAX_PROCESS_ID" not in os.environ:
  sys.exit(main(sys.argv[1:]))
rank = int(os.environ["SPARSEJAX_PROCESS_ID"])
after = os.environ.get("PIN_AFTER") == "1"
if not after:
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % 2]})

from sparsejax import cluster  # noqa: E402

cluster.initialize()
import jax  # noqa: E402

jax.devices()  # XLA starts here
if after:  # every thread: XLA's executor threads too
  from sparsejax.bench import pin_to_core  # noqa: E402
  pin_to_core(rank)
from experiments.jax_runner import JaxRun  # noqa: E402
from experiments.tta_systems import load_task  # noqa: E402

config = load_task(os.path.join(ROOT, "configs", "tta_kjv_lm.py"), [
    "compression.algorithm=dense", "overlap.pipeline=" + os.environ.get("PIPE", "device")])
run = JaxRun(config, (2, 1))
for i in range(3):
  run.step(i, wait=True)
phases = run.pipeline_phases(10, 10, 5) if run.pipe else {}
steady = []
for i in range(5):
  t0 = time.perf_counter()
  run.step(20 + i, wait=True, level_step=20)
  steady.append(time.perf_counter() - t0)
if rank == 0:
  print("pinned", "after" if after else "before", "XLA starts:",
        {k: round(v * 1e3, 1) for k, v in phases.items()},
        "steady steps", sorted(round(x * 1e3, 1) for x in steady), flush=True)
