"""Every test sees 8 CPU devices (set before jax is imported anywhere)."""

import os
import tempfile
import zlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiled programs are cached on disk for the session: a resumed run compiles nothing again.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"sparsejax-test-jit-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() == 8, f"tests need 8 CPU devices, got {jax.devices()}"


def need_root(what: str = "test") -> None:
  """Skips a test of the emulated cluster (network namespaces need root) when not root; in CI,
  which runs as root, a missing root is a failure."""
  if os.geteuid() != 0:
    if os.environ.get("CI"):
      pytest.fail(f"CI runs as root: the emulated-cluster {what} must run there")
    pytest.skip("needs root (network namespaces): run as root, e.g. sudo -E python -m pytest -q")


def make_mesh(nodes: int, local: int) -> Mesh:
  """A ("node", "local") mesh over the first nodes*local CPU devices."""
  return Mesh(np.asarray(jax.devices()[: nodes * local]).reshape(nodes, local), ("node", "local"))


def run_workers(mesh: Mesh, fn, *stacked):
  """Runs `fn` once per worker inside shard_map over both mesh axes.

  Each argument is a pytree of arrays with a leading worker axis of size nodes*local (node-major);
  worker w sees `arg[w]`. Every output gets the same leading worker axis back, as numpy.
  """
  spec = P(("node", "local"))
  placed = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), stacked)

  def body(*args):
    args = jax.tree.map(lambda a: a[0], args)
    return jax.tree.map(lambda o: jnp.asarray(o)[None], fn(*args))

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))(*placed)
  return jax.tree.map(np.asarray, out)


def override(config, changes: dict):
  """Sets dotted keys (`"optimizer.name": "lars"`) on a ConfigDict in place; returns it."""
  for key, value in changes.items():
    node = config
    *path, last = key.split(".")
    for part in path:
      node = node[part]
    node[last] = value
  return config


@pytest.fixture
def rng(request):
  """A fresh generator per test, seeded from the test's name (reproducible, not shared)."""
  return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def fake_imagenet(tmp_path_factory):
  """A generated ImageNet manual download (4 classes x 6 real JPEGs of varied sizes, one grey,
  one corrupt; 8 validation images) prepared by TFDS's real imagenet2012 builder into ArrayRecord.
  Returns (data_dir, info from fake_manual_dir, root)."""
  try:
    import tensorflow  # noqa: F401
  except ModuleNotFoundError:
    if os.environ.get("CI"):
      pytest.fail("CI must install the prepare extra (tensorflow-cpu) for the ImageNet tests")
    pytest.skip("needs TensorFlow to prepare ImageNet with TFDS: pip install -e '.[prepare]'")
  from sparsejax.data import imagenet
  root = tmp_path_factory.mktemp("imagenet")
  info = imagenet.fake_manual_dir(str(root / "manual"), classes=4, per_class=6, val=8, corrupt=1,
                                  min_side=40, max_side=150, seed=1)
  imagenet.prepare(str(root / "manual"), str(root / "data"))
  return str(root / "data"), info, root
