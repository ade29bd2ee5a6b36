"""A fresh clone in any folder: no committed file names an absolute path of a machine, and the
committed results store their paths relative to the checkout (readers resolve them there)."""

import json
import os
import re
import subprocess

import pytest

from sparsejax import bench as results_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A path is absolute-and-machine-specific when it starts at "/" with a first folder that is not
# one of the system's own (a Debian package's files under /usr/share, /dev/shm, /proc/self...).
SYSTEM_DIRS = ("usr", "dev", "proc", "sys", "etc", "bin", "sbin", "lib", "lib64")
MACHINE_PATH = re.compile(r"(?<![\w.:/~$}\])>-])/(?!(?:" + "|".join(SYSTEM_DIRS)
                          + r")/)([A-Za-z_][\w.-]*)/[\w.-]")
BINARY = (".png", ".jpg", ".jpeg", ".gz", ".npz", ".npy", ".zip", ".tar")


def committed_files() -> list[str]:
  """The files git tracks (the repository as a clone gets it); the tree where git is absent."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    files = [f for f in out.stdout.decode().split("\0") if f]
  except (OSError, subprocess.CalledProcessError):
    files = []
  if not files:
    skip = {".git", ".venv", ".ci-venv", "runs", "build", "__pycache__", ".pytest_cache"}
    for top, dirs, names in os.walk(ROOT):
      dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
      files += [os.path.relpath(os.path.join(top, n), ROOT) for n in names]
  return sorted(f for f in files if not f.endswith(BINARY))


def machine_paths(text: str) -> list[str]:
  return [m.group(0) for m in MACHINE_PATH.finditer(text)]


def test_the_pattern_finds_machine_paths_and_leaves_the_rest():
  found = machine_paths('--lock /work/bench.lock "config": "/home/a/x.py" `--out /tmp/r.json`'
                        " /Users/me/data ('/scratch/run')")
  assert [p.split("/")[1] for p in found] == ["work", "home", "tmp", "Users", "scratch"]
  assert machine_paths("/usr/share/datasets/fashion-mnist /dev/shm/x #!/usr/bin/env bash "
                       "https://github.com/google/jax/blob/main/x.py runs/quickstart a/b/c "
                       "1/sqrt(n) MB/s $OUT/topk.json studies/auto/results/x.json") == []


def test_no_committed_file_names_an_absolute_machine_path():
  me = os.path.relpath(__file__, ROOT)
  bad = []
  for name in committed_files():
    if name == me:
      continue
    try:
      with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        lines = f.read().splitlines()
    except (UnicodeDecodeError, FileNotFoundError):
      continue
    bad += [f"{name}:{i}: {p}" for i, line in enumerate(lines, 1) for p in machine_paths(line)]
  assert not bad, ("committed files name absolute machine paths (use paths relative to the "
                   "repository, or placeholders such as $WORKDIR):\n" + "\n".join(bad))


def test_commands_in_results_are_portable():
  argv = ["--config", os.path.join(ROOT, "configs", "quickstart.py"), "--lock",
          "/var/lock/bench.lock", f"--out={os.path.join(ROOT, 'runs', 'x.json')}", "--seeds", "3",
          "/srv/elsewhere/data"]
  got = results_io.command_line(os.path.join(ROOT, "benchmarks", "topk.py"), argv)
  assert got == ("python -m benchmarks.topk --config configs/quickstart.py --lock $LOCK "
                 "--out=runs/x.json --seeds 3 $PATH")
  assert results_io.portable_path(os.path.join(ROOT, "configs", "x.py")) == "configs/x.py"
  assert results_io.resolve("configs/x.py") == os.path.join(ROOT, "configs", "x.py")
  assert results_io.resolve("/abs/x.py") == "/abs/x.py"


@pytest.mark.parametrize("name", ["time_to_accuracy/results/time_to_accuracy.json",
                                  "scaling_model/results/scaling_model.json"])
def test_committed_results_name_files_of_the_checkout(name):
  """The time-to-accuracy study's config and the scaling model's source are relative paths that
  resolve to files of this checkout."""
  with open(os.path.join(ROOT, "studies", name)) as f:
    got = json.load(f)
  path = got["meta"]["config"] if "meta" in got else got["comm_source"]
  assert not os.path.isabs(path)
  assert os.path.isfile(results_io.resolve(path)), path
