"""What one message costs over the emulated link beyond its bytes: time against size.

  python -m benchmarks.link [--rates 100mbit,unlimited] [--queues 0.4] [--gaps 0,0.1]
                            [--sizes 16k,64k,256k,1m,4m] [--reps 15] [--runs 3] [--lock FILE]
                            [--out benchmarks/results/bench_link.json]      (needs root)

The cluster: 2 nodes x 1 process (`sparsejax.cluster.EmulatedCluster`, tc tbf on both ends of
each node's veth, its 16 KB burst; `--queues`: the seconds of traffic a link queues, tbf's
latency, 0.4 in every study). For each size S (bytes a node sends, a multiple of 4) and each gap
(seconds idle before each call, as a training step's compute leaves the link idle between
exchanges), it times:

  tcp           S bytes over one TCP connection from node 0 to node 1, then a 1-byte reply
                (TCP_NODELAY on both ends): the link and the kernel's TCP alone;
  all_gather    JAX's all_gather of S bytes a worker over the 2 processes (gloo): the
                collective a sparse exchange's pairs take;
  psum          JAX's psum of an S-byte buffer (a ring all-reduce over 2 workers sends half of
                it in each of its two phases): a dense exchange's collective;
  all_to_all    JAX's all_to_all of a 2S-byte buffer (half of it to the other process): with
                an all_gather, the bfloat16 dense sum's collectives (`comm.dense_sum`).

Each row: the median and quartiles over `--reps` calls after a warm-up, and the excess over the
bytes at the link's rate (`link_bound_s`: what the token bucket refilled during the gap, up to
its burst, crosses unshaped, the rest at the rate; payload only, so TCP/IP's headers, about
3.5%, are in the excess). The table: min / median / max over `--runs` separate clusters and
processes. Writes JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time

import numpy as np

from sparsejax.bench import (
  command_line,
  exclusive,
  footer,
  git_commit,
  json_path,
  launch_workers,
  python_module,
  spread,
  time_stats,
  write_results,
)

SIZE_UNITS = {"k": 1024, "m": 1024 * 1024}
PORT = 29731  # inside the cluster's own namespaces: no other listener there
BURST_BYTES = 16 * 1024  # EmulatedCluster's


def parse_size(text: str) -> int:
  """Bytes, optionally with k or m (16k, 1m): a positive multiple of 4 (float32 values)."""
  text = text.strip().lower()
  digits, unit = (text[:-1], SIZE_UNITS[text[-1]]) if text[-1:] in SIZE_UNITS else (text, 1)
  if not digits.isdigit() or int(digits) * unit <= 0 or int(digits) * unit % 4:
    raise ValueError(f"size {text!r}: give a positive number of bytes, a multiple of 4, "
                     "optionally with k or m (16k, 1m)")
  return int(digits) * unit


def link_bound_s(size: int, gap_s: float, rate_bps: int | None) -> float:
  """Seconds `size` bytes take at the rate after `gap_s` idle (None: unlimited, 0): tbf's
  bucket refills at the rate while idle, up to its burst, and that much goes out at once."""
  if rate_bps is None:
    return 0.0
  credit = min(BURST_BYTES, gap_s * rate_bps / 8)
  return max(size - credit, 0) * 8 / rate_bps


def _recv_exactly(sock: socket.socket, n: int, buf: bytearray) -> None:
  view, got = memoryview(buf), 0
  while got < n:
    r = sock.recv_into(view[got:n])
    if r == 0:
      raise ConnectionError("peer closed")
    got += r


def tcp_server(args) -> None:
  """Node 1: for each message, reads its 8-byte length and that many bytes, replies 1 byte;
  ends when the client closes the connection."""
  buf, head = bytearray(max(map(parse_size, args.sizes.split(",")))), bytearray(8)
  with socket.create_server((args.host, PORT)) as srv:
    srv.settimeout(120)
    conn, _ = srv.accept()
    with conn:
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      while True:
        try:
          _recv_exactly(conn, 8, head)
        except ConnectionError:
          return
        _recv_exactly(conn, int.from_bytes(head, "little"), buf)
        conn.sendall(b"k")


def _connect(host: str, timeout_s: float = 60) -> socket.socket:
  deadline = time.time() + timeout_s
  while True:
    try:
      return socket.create_connection((host, PORT), timeout=120)
    except OSError:
      if time.time() > deadline:
        raise
      time.sleep(0.2)


def tcp_client(args) -> list[dict]:
  """Node 0: each case's `reps` messages (after one more as a warm-up), each after the gap."""
  rows, ack = [], bytearray(1)
  with _connect(args.host) as sock:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for gap in map(float, args.gaps.split(",")):
      for n in map(parse_size, args.sizes.split(",")):
        payload = n.to_bytes(8, "little") + os.urandom(n)
        times = []
        for i in range(args.reps + 1):
          time.sleep(gap)
          t0 = time.perf_counter()
          sock.sendall(payload)
          _recv_exactly(sock, 1, ack)
          if i:
            times.append(time.perf_counter() - t0)
        rows.append({"what": "tcp", "size": n, "gap_s": gap, **time_stats(times)})
  return rows


def jax_worker(args) -> None:
  from sparsejax import cluster
  cluster.initialize()
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((jax.device_count(),), ("w",))
  spec = NamedSharding(mesh, P("w"))
  barrier = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "w"), mesh=mesh, in_specs=P("w"),
                                  out_specs=P()))
  token = jax.make_array_from_process_local_data(spec, np.ones(1, np.float32))
  # name: (the collective, its buffer's length in S's): each sends S bytes from a node
  calls = {"all_gather": (lambda x: jax.lax.all_gather(x, "w", tiled=True), 1),
           "psum": (lambda x: jax.lax.psum(x, "w"), 1),
           "all_to_all": (lambda x: jax.lax.all_to_all(x, "w", 0, 0, tiled=True), 2)}
  rows = []
  for n in map(parse_size, args.sizes.split(",")):
    for name, (fn, scale) in calls.items():
      x = jax.make_array_from_process_local_data(
          spec, np.random.default_rng(0).standard_normal(scale * n // 4).astype(np.float32))
      f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("w"), out_specs=P("w"),
                                check_vma=False))
      jax.block_until_ready(f(x))  # compile + warm-up
      for gap in map(float, args.gaps.split(",")):
        times = []
        for _ in range(args.reps):
          jax.block_until_ready(barrier(token))
          time.sleep(gap)
          t0 = time.perf_counter()
          jax.block_until_ready(f(x))
          times.append(time.perf_counter() - t0)
        rows.append({"what": name, "size": n, "gap_s": gap, **time_stats(times)})
  if jax.process_index() == 0:
    with open(args.worker_out, "w") as f:
      json.dump(rows, f)


def run_tcp(c, args) -> list[dict]:
  argv = ["--host", c.address(1), "--sizes", args.sizes, "--gaps", args.gaps, "--reps",
          str(args.reps)]
  server = subprocess.Popen([*c.exec_prefix(1), *python_module(__file__), "--mode", "server",
                             *argv])
  try:  # the client's errors go to this process's stderr
    out = subprocess.run([*c.exec_prefix(0), *python_module(__file__), "--mode", "client",
                          *argv], stdout=subprocess.PIPE, text=True, timeout=1800,
                         check=True).stdout
  finally:
    try:
      server.wait(timeout=30)  # it ends when the client closes the connection
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()
  return json.loads(out.splitlines()[-1])


def run(args) -> list[dict]:
  """Every run: each rate (each queue at a limited rate) on a cluster of its own."""
  from sparsejax import cluster
  rows = []
  for run_index in range(args.runs):  # every case once per run: a slow spell hits all alike
    for rate_name in args.rates.split(","):
      bps = None if rate_name == "unlimited" else cluster.parse_rate(rate_name)
      for queue_s in ([None] if bps is None else map(float, args.queues.split(","))):
        with exclusive(args.lock), cluster.EmulatedCluster(
            2, bps, burst_bytes=BURST_BYTES, queue_s=0.4 if queue_s is None else queue_s) as c:
          found = run_tcp(c, args) + launch_workers(
              c, __file__, ["--sizes", args.sizes, "--gaps", args.gaps, "--reps",
                            str(args.reps)],
              mode="jax", procs_per_node=1, devices_per_proc=1, log=sys.stdout, what="jax")
        for r in found:
          bound = link_bound_s(r["size"], r["gap_s"], bps)
          r.update(run=run_index, rate=rate_name, queue_s=queue_s, bytes_s=bound,
                   excess_s=r["median_s"] - bound)
          rows.append(r)
  return rows


def make_table(rows: list[dict], meta: dict) -> str:
  """One line a case: its median over the calls of each run, min / median / max over runs."""
  cases: dict[tuple, list[dict]] = {}
  for r in rows:
    cases.setdefault((r["rate"], r["queue_s"], r["gap_s"], r["what"], r["size"]), []).append(r)
  lines = ["| rate | queue s | gap s | what | size KB | median s | bytes at rate s | "
           "excess ms | q3 - median ms |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
  for (rate, queue_s, gap, what, size), rs in cases.items():
    lines.append(
        f"| {rate} | {'-' if queue_s is None else f'{queue_s:g}'} | {gap:g} | {what} | "
        f"{size / 1024:g} | {spread([r['median_s'] for r in rs], 4)} | {rs[0]['bytes_s']:.4f} | "
        f"{spread([r['excess_s'] for r in rs], 1, 1e3)} | "
        f"{spread([r['q3_s'] - r['median_s'] for r in rs], 1, 1e3)} |")
  return "\n".join(lines + ["", footer(meta)])


def _check(ap: argparse.ArgumentParser, args) -> None:
  """Every argument checked before a cluster is built."""
  from sparsejax import cluster
  try:
    for s in args.sizes.split(","):
      parse_size(s)
    for rate in args.rates.split(","):
      if rate != "unlimited":
        cluster.parse_rate(rate)
    for q in args.queues.split(","):
      if not 0.001 <= float(q) <= 10:
        raise ValueError(f"queue {q}: must be in [0.001, 10] seconds")
    for g in args.gaps.split(","):
      if not 0 <= float(g) <= 10:
        raise ValueError(f"gap {g}: must be in [0, 10] seconds")
  except ValueError as e:
    ap.error(str(e))
  if args.reps < 1 or args.runs < 1:
    ap.error(f"--reps and --runs must be at least 1, got {args.reps} and {args.runs}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rates", default="100mbit,unlimited",
                  help="link rates (as `sparsejax launch --bandwidth`, or unlimited)")
  ap.add_argument("--queues", default="0.4",
                  help="seconds of traffic a limited link queues (tc tbf's latency)")
  ap.add_argument("--sizes", default="16k,64k,256k,1m,4m", help="bytes a node sends a call")
  ap.add_argument("--gaps", default="0,0.1", help="seconds idle before each call")
  ap.add_argument("--reps", type=int, default=15, help="timed calls a case and run")
  ap.add_argument("--runs", type=int, default=3, help="separate clusters and processes")
  ap.add_argument("--lock", help="hold this flock while timing (benchmarks sharing a machine)")
  ap.add_argument("--mode", choices=("driver", "server", "client", "jax"), default="driver",
                  help=argparse.SUPPRESS)
  ap.add_argument("--host", help=argparse.SUPPRESS)
  ap.add_argument("--worker-out", help=argparse.SUPPRESS)
  ap.add_argument("--out", type=json_path)
  args = ap.parse_args(argv)
  _check(ap, args)
  if args.mode != "driver":
    worker = {"server": tcp_server, "jax": jax_worker}.get(args.mode)
    if worker is not None:
      worker(args)
    else:
      print(json.dumps(tcp_client(args)))
    return 0
  import jax
  meta = {"command": command_line(__file__, sys.argv[1:] if argv is None else argv),
          "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
          "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "rates": args.rates,
          "queues_s": args.queues, "gaps_s": args.gaps, "sizes": args.sizes,
          "burst_bytes": BURST_BYTES, "runs": args.runs, "reps": args.reps}
  rows = run(args)
  table = make_table(rows, meta)
  print(table)
  if args.out:
    write_results(args.out, {"meta": meta, "rows": rows}, table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
