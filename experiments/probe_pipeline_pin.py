"""Probe: does pinning a node process to one core before XLA starts serialise the pipelined
exchange? One emulated node per process, two CPU devices each; rank 0 prints the pipelined
step's halves alone, their timeline together and five steady steps (ms). Root:

  PIN_AFTER=0 python ../shared/probes/run_probe.py experiments/probe_pipeline_pin.py 200mbit 2
  PIN_AFTER=1 python ../shared/probes/run_probe.py experiments/probe_pipeline_pin.py 200mbit 2
  PIPE= PIN_AFTER=1 python ../shared/probes/run_probe.py experiments/probe_pipeline_pin.py \\
      200mbit 1                                                         # unpipelined, 1 device

(`run_probe.py` launches `cluster.launch([probe], nodes=2, devices_per_proc=...)`.)
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
rank = int(os.environ["SPARSEJAX_PROCESS_ID"])
after = os.environ.get("PIN_AFTER") == "1"
if not after:
  os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % 2]})

from sparsejax import cluster  # noqa: E402

cluster.initialize()
import jax  # noqa: E402

jax.devices()  # XLA starts here
if after:  # every thread: XLA's executor threads too
  from experiments.time_to_accuracy import pin_to_core  # noqa: E402
  pin_to_core(rank)
from experiments.jax_runner import JaxRun  # noqa: E402
from experiments.tta_systems import load_task  # noqa: E402

config = load_task(os.path.join(ROOT, "configs", "tta_kjv_lm.py"), [
    "compression.algorithm=dense", "compression.pipeline=" + os.environ.get("PIPE", "device")])
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
