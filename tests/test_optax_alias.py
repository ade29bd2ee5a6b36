"""optax's own optimizer tests (optax/_src/alias_test.py) run against the four fused optimizers.

The cases of alias_test.py that apply to sgd, adamw, lars and lamb, with optax's hyperparameters,
problems and tolerances, on both faces: "pytree" (the optax drop-in) and "flat" (params, updates
and state are one buffer of a `FlatLayout`; the problem is posed on that buffer). Deviations from
optax, all documented in `sparsejax.optim`: moment buffers are flat (so `tree_map_params` maps
them, not trees of the params' shape) and float32 unless `accumulator_dtype`/`mu_dtype` asks for
another dtype (optax: the params' dtype); a complex state dtype means its parts' dtype.

Cost: each test jits once (several problems in one program where optax runs them apart), 10,000
steps run inside `lax.fori_loop`, `pmap` variants use 2 devices. chex's variants (jit, no jit,
pmap) all run with `-m slow`; CI runs jit everywhere and pmap for inject_hyperparams.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import sparsejax as sj
from sparsejax import cpu_kernels, optim

FUSED = {"sgd": optim.fused_sgd, "adamw": optim.fused_adamw, "lars": optim.fused_lars,
         "lamb": optim.fused_lamb}
OPTAX = {"sgd": optax.sgd, "adamw": optax.adamw, "lars": optax.lars, "lamb": optax.lamb}
# optax's _OPTIMIZERS_UNDER_TEST entries for these four.
KWARGS = {"sgd": {"learning_rate": 1e-3, "momentum": 0.9}, "adamw": {"learning_rate": 1e-1},
          "lars": {"learning_rate": 1.0}, "lamb": {"learning_rate": 1e-3}}
NAMES = list(FUSED)
FACES = ["pytree", "flat"]


def _setup_parabola(dtype):
  initial = jnp.array([-1.0, 10.0, 1.0], dtype=dtype)
  final = jnp.array([1.0, -1.0, 1.0], dtype=dtype)
  if jnp.iscomplexobj(final):
    final *= 1 + 1j
  return initial, final, lambda p: jnp.sum(jnp.abs(p - final) ** 2)


def _setup_rosenbrock(dtype):
  a, b = 1.0, 100.0
  if jnp.issubdtype(dtype, jnp.complexfloating):
    a *= 1 + 1j
  initial = jnp.array([0.0, 0.0], dtype=dtype)
  final = jnp.array([a, a**2], dtype=dtype)
  return initial, final, lambda p: (jnp.abs(a - p[0]) ** 2
                                    + b * jnp.abs(p[1] - p[0] ** 2) ** 2)


class Face:
  """One problem posed on one face: `to(tree)` gives the face's params, `back(params)` the tree,
  `factory(**kwargs)` builds the optimizer for them."""

  def __init__(self, face, name, example):
    self.face, self.name = face, name
    self.layout = optim.flat_layout(example) if face == "flat" else None

  @property
  def factory(self):
    if self.layout is None:
      return FUSED[self.name]
    return functools.partial(FUSED[self.name], layout=self.layout)

  def make(self, **kwargs):
    return self.factory(**(kwargs or KWARGS[self.name]))

  def to(self, tree):
    return tree if self.layout is None else self.layout.ravel(tree, self.layout.real_dtype)

  def back(self, params):
    return params if self.layout is None else self.layout.unravel(params)

  def objective(self, objective):
    return objective if self.layout is None else (lambda flat: objective(self.back(flat)))


def conj_grad(objective, params):
  # Complex gradients are conjugated before being applied (as in optax's test); a no-op on reals.
  return jax.tree.map(jnp.conj, jax.grad(objective)(params))


SLOW = pytest.mark.slow
ALL_VARIANTS = ["jit", pytest.param("eager", marks=SLOW), pytest.param("pmap", marks=SLOW)]


def variant(kind, fn):
  """chex's variants: jit, no jit, and pmap (over 2 devices, the arguments broadcast)."""
  if kind == "jit":
    return jax.jit(fn)
  if kind == "eager":
    return fn

  def on_two_devices(*args):
    stacked = jax.tree.map(lambda x: np.stack([np.asarray(x)] * 2), args)
    out = jax.pmap(fn, devices=jax.devices()[:2])(*stacked)
    return jax.tree.map(lambda x: np.asarray(x)[0], out)
  return on_two_devices


# ----------------------------------------------------------------------------- test_optimization

PROBLEMS = [(target, dtype) for target in (_setup_parabola, _setup_rosenbrock)
            for dtype in (jnp.float32, jnp.complex64)]


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_optimization(name, face):
  """10,000 steps on the parabola and Rosenbrock, float32 and complex64, reach the optimum to
  optax's tolerance (rtol = atol = 3e-2); tree_map_params with the identity first."""
  runs = []
  for target, dtype in PROBLEMS:
    initial, final, objective = target(dtype)
    f = Face(face, name, initial)
    opt = f.make()
    state = opt.init(f.to(initial))
    state = optax.tree.map_params(opt, lambda v: v, state)
    runs.append((f, opt, f.objective(objective), f.to(initial), state, final))

  @jax.jit
  def optimize(starts):
    out = []
    for (_, opt, objective, _, _, _), (params, state) in zip(runs, starts):
      def step(_, carry, opt=opt, objective=objective):
        params, state = carry
        updates, state = opt.update(conj_grad(objective, params), state, params)
        return optax.apply_updates(params, updates), state
      out.append(lax.fori_loop(0, 10_000, step, (params, state))[0])
    return out

  finals = optimize([(r[3], r[4]) for r in runs])
  for (f, _, _, _, _, final), got, (target, dtype) in zip(runs, finals, PROBLEMS):
    np.testing.assert_allclose(np.asarray(f.back(got)), np.asarray(final), rtol=3e-2, atol=3e-2,
                               err_msg=f"{target.__name__} {jnp.dtype(dtype).name}")


# ----------------------------------------------------------------------------- extra args


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_optimizers_accept_extra_args(name, face):
  initial, _, objective = _setup_rosenbrock(jnp.float32)
  f = Face(face, name, initial)
  opt, objective = f.make(), f.objective(objective)
  assert isinstance(opt, optax.GradientTransformationExtraArgs)

  @jax.jit
  def step(params, state):
    updates = jax.grad(objective)(params)
    updates, state = opt.update(updates, state, params,
                                unexpected_extra_args_your_optimizer_doesnt_expect=1)
    return optax.apply_updates(params, updates), state

  params = f.to(initial)
  state = opt.init(params)
  for _ in range(2):
    params, state = step(params, state)
  assert np.all(np.isfinite(np.asarray(params))) and int(state.count) == 2


# ----------------------------------------------------------------------------- inject_hyperparams


def _inject_problem():
  params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
  grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
  return params, grads


@pytest.mark.parametrize("kind", ["jit", pytest.param("eager", marks=SLOW), "pmap"])
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_optimizers_can_be_wrapped_in_inject_hyperparams(name, face, kind):
  params, grads = _inject_problem()
  f = Face(face, name, params)
  params, grads = f.to(params), f.to(grads)
  opt = f.make()
  opt_inject = optax.inject_hyperparams(f.factory)(**KWARGS[name])
  state = variant(kind, opt.init)(params)
  updates, new_state = variant(kind, opt.update)(grads, state, params)
  state_inject = variant(kind, opt_inject.init)(params)
  updates_inject, new_state_inject = variant(kind, opt_inject.update)(grads, state_inject, params)
  for got, want in zip(jax.tree.leaves((updates_inject, new_state_inject.inner_state)),
                       jax.tree.leaves((updates, new_state))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_learning_rate_changed_through_the_state_acts_as_in_optax(name, face):
  """Set the learning rate in inject_hyperparams' state (the way optax users change it), for the
  fused optimizer and for optax's: the updates before and after the change agree with optax's."""
  params, grads = _inject_problem()
  f = Face(face, name, params)
  new_lr = 0.37 * KWARGS[name]["learning_rate"]
  fused = optax.inject_hyperparams(f.factory)(**KWARGS[name])
  reference = optax.inject_hyperparams(OPTAX[name])(**KWARGS[name])

  def two_steps(opt, params, grads):
    state = opt.init(params)
    update = jax.jit(opt.update)
    u1, state = update(grads, state, params)
    state.hyperparams["learning_rate"] = jnp.asarray(new_lr, jnp.float32)
    u2, state = update(grads, state, optax.apply_updates(params, u1))
    return u1, u2

  got = [f.back(u) for u in two_steps(fused, f.to(params), f.to(grads))]
  want = two_steps(reference, params, grads)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-8)
  assert not np.allclose(np.asarray(jax.tree.leaves(got[1])[0]),
                         np.asarray(jax.tree.leaves(got[0])[0]))  # the change did act


@pytest.mark.parametrize("name", NAMES)
def test_traced_hyperparameters_on_both_paths(name):
  """Every numeric hyperparameter injected (traced): the C++ kernel and the XLA path (GPU, no
  compiler) give the same updates, equal to optax's injected optimizer with the same values."""
  params, grads = _inject_problem()
  kwargs = {"sgd": {"learning_rate": 0.1, "momentum": 0.8, "weight_decay": 0.01},
            "adamw": {"learning_rate": 0.1, "b1": 0.8, "b2": 0.9, "eps": 1e-6,
                      "eps_root": 1e-9, "weight_decay": 0.05},
            "lars": {"learning_rate": 0.5, "weight_decay": 0.01, "trust_coefficient": 0.02,
                     "eps": 1e-6, "momentum": 0.8},
            "lamb": {"learning_rate": 0.1, "b1": 0.8, "b2": 0.9, "eps": 1e-5,
                     "weight_decay": 0.01}}[name]
  reference = kwargs.copy()
  if name == "sgd":  # fused_sgd's weight decay is optax's add_decayed_weights in front of sgd
    def decayed_sgd(learning_rate, momentum, weight_decay):
      return optax.chain(optax.add_decayed_weights(weight_decay),
                         optax.sgd(learning_rate, momentum))
    ref = optax.inject_hyperparams(decayed_sgd)(**reference)
  else:
    ref = optax.inject_hyperparams(OPTAX[name])(**reference)

  def two_steps(opt):
    state, update = opt.init(params), jax.jit(opt.update)
    u1, state = update(grads, state, params)
    u2, _ = update(grads, state, optax.apply_updates(params, u1))
    return u1, u2

  want = two_steps(ref)
  kernel = two_steps(optax.inject_hyperparams(FUSED[name])(**kwargs))
  with cpu_kernels.disabled():
    xla = two_steps(optax.inject_hyperparams(FUSED[name])(**kwargs))
  for k, x, w in zip(jax.tree.leaves(kernel), jax.tree.leaves(xla), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(k), np.asarray(x), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(np.asarray(k), np.asarray(w), rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------------------- explicit dtype

DTYPES = ["bfloat16", "float32", "complex64", None]


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("opt_name", ["sgd_mom", "adamw"])
def test_explicit_dtype(opt_name, face):
  """optax: the moment has `state_dtype` (params' dtype for None). Fused: the same for a real
  dtype; a complex one means its parts' dtype (complex values are stored as pairs of reals),
  None means float32 (the fused optimizers' documented default)."""
  for params_dtype in DTYPES:
    for state_dtype in DTYPES:
      params = jnp.array([0.0, 0.0], dtype=params_dtype or jnp.float32)
      f = Face(face, "sgd" if opt_name == "sgd_mom" else "adamw", params)
      if opt_name == "sgd_mom":
        opt = f.factory(0.1, momentum=0.9, accumulator_dtype=state_dtype)
        attribute = opt.init(f.to(params)).momentum
      else:
        opt = f.factory(0.1, mu_dtype=state_dtype)
        attribute = opt.init(f.to(params)).mu
      expected = jnp.dtype(state_dtype or jnp.float32)
      if jnp.issubdtype(expected, jnp.complexfloating):
        expected = jnp.finfo(expected).dtype
      assert attribute.dtype == expected, (params_dtype, state_dtype)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("opt_name", ["sgd_mom", "adamw"])
def test_explicit_dtype_is_kept_through_updates(opt_name, face):
  """A bfloat16 moment stays bfloat16 through updates, which agree with optax's under the same
  storage dtype to bfloat16 rounding (the fused update reads the moment before rounding it for
  storage; optax's SGD after)."""
  params = jnp.array([0.5, -2.0, 3.0], jnp.float32)
  grads = jnp.array([0.25, 1.0, -3.0], jnp.float32)
  f = Face(face, "sgd" if opt_name == "sgd_mom" else "adamw", params)
  if opt_name == "sgd_mom":
    opt = f.factory(0.1, momentum=0.9, accumulator_dtype=jnp.bfloat16)
    ref = optax.sgd(0.1, momentum=0.9, accumulator_dtype=jnp.bfloat16)
  else:
    opt = f.factory(0.1, mu_dtype=jnp.bfloat16)
    ref = optax.adamw(0.1, mu_dtype=jnp.bfloat16)
  state, ref_state = opt.init(f.to(params)), ref.init(params)
  for _ in range(3):
    u, state = jax.jit(opt.update)(f.to(grads), state, f.to(params))
    w, ref_state = ref.update(grads, ref_state, params)
  assert jax.tree.leaves(state)[1].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(f.back(u)), np.asarray(w), rtol=1e-2)


# ----------------------------------------------------------------------------- preserve dtype


@pytest.mark.parametrize("kind", ALL_VARIANTS)
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_preserve_dtype(name, face, kind):
  """Updates come back in the gradients' dtype (bfloat16 and float32)."""
  for dtype in (jnp.bfloat16, jnp.float32):
    params = jnp.array([1.0, 2.0], dtype=dtype)
    f = Face(face, name, params)
    opt = f.make()
    params = f.to(params)
    grads = jax.grad(f.objective(lambda x: jnp.sum(x**2)))(params)
    state = variant(kind, opt.init)(params)
    updates, _ = variant(kind, opt.update)(grads, state, params)
    assert updates.dtype == grads.dtype == dtype


# ----------------------------------------------------------------------------- stability


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_state_shape_dtype_shard_stability(name, face):
  """Two steps under jit with the update inside lax.cond: params keep their dtype (float16,
  bfloat16, float32, complex64; float64 and complex128 with x64 enabled)."""
  for x64, dtypes in ((False, (jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64)),
                      (True, (jnp.float64, jnp.complex128))):
    with jax.enable_x64(x64):
      runs = []
      for dtype in dtypes:
        initial, _, objective = _setup_parabola(dtype)
        f = Face(face, name, initial)
        opt = f.make()
        runs.append((opt, f.objective(objective), f.to(initial)))

      @jax.jit
      def step(carries, runs=runs):
        out = []
        for (opt, objective, _), (params, state) in zip(runs, carries):
          updates = conj_grad(objective, params)
          cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
          updates, state = lax.cond(
              cond, lambda opt=opt, u=updates, s=state, p=params: opt.update(u, s, p),
              lambda p=params, s=state: (p, s))
          out.append((optax.apply_updates(params, updates), state))
        return out

      carries = [(params, opt.init(params)) for opt, _, params in runs]
      for _ in range(2):
        carries = step(carries)
        for (params, _), (_, _, start), dtype in zip(carries, runs, dtypes):
          # the flat face's buffer is real: a complex problem's buffer has its parts' dtype
          assert params.dtype == start.dtype, (params.dtype, dtype)


# ----------------------------------------------------------------------------- accumulation


@pytest.mark.parametrize("kind", ALL_VARIANTS)
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_gradient_accumulation(name, face, kind):
  """optax.MultiSteps(opt, 4): the first micro-step's update is exactly zero."""
  for dtype in (jnp.bfloat16, jnp.float32):
    params = jnp.array([1.0, 2.0], dtype=dtype)
    f = Face(face, name, params)
    opt = optax.MultiSteps(f.make(), every_k_schedule=4)
    params = f.to(params)
    grads = jax.grad(f.objective(lambda x: jnp.sum(x**2)))(params)
    state = variant(kind, opt.init)(params)
    updates, _ = variant(kind, opt.update)(grads, state, params)
    np.testing.assert_array_equal(np.asarray(updates, np.float32), 0.0)
    assert updates.dtype == grads.dtype


# ----------------------------------------------------------------------------- map_params, empty


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name", NAMES)
def test_map_params_and_empty_trees(name, face):
  """tree_map_params maps the moment buffers (the params' stand-in), nothing else; an empty tree
  has an empty state and an empty update, as in optax."""
  params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
  f = Face(face, name, params)
  opt = f.make()
  state = opt.init(f.to(params))
  mapped = optax.tree.map_params(opt, lambda v: jnp.full_like(v, 7.0), state)
  assert int(mapped.count) == 0 and mapped.count.dtype == jnp.int32
  moments = [x for x in jax.tree.leaves(mapped) if x.ndim == 1]
  assert moments and all(np.all(np.asarray(x) == 7.0) for x in moments)
  kept = optax.tree.map_params(opt, lambda v: v, state,
                               transform_non_params=lambda v: v + 1)
  assert int(kept.count) == 1  # the count is not a params-like tree

  for empty in ({}, [], None):
    state = opt.init(empty)
    updates, state = jax.jit(opt.update)(empty, state, empty)
    assert updates == empty and int(state.count) == 1


# ----------------------------------------------------------------------------- against optax

MATCH_CASES = [("sgd", KWARGS["sgd"]), ("adamw", KWARGS["adamw"]), ("lars", KWARGS["lars"]),
               ("lamb", KWARGS["lamb"]),
               ("adamw", {"learning_rate": 1e-1, "nesterov": True, "weight_decay": 1e-2}),
               ("sgd", {"learning_rate": 1e-3, "momentum": 0.9, "nesterov": True})]


@pytest.mark.parametrize("name,kwargs", MATCH_CASES)
def test_per_step_updates_match_optax(name, kwargs):
  """Pytree face: 10 steps on each of optax's problems (parabola, Rosenbrock; float32, complex64)
  give optax's updates within 1e-5 relative (to each step's largest update)."""
  runs = [target(dtype) for target, dtype in PROBLEMS]
  fused, reference = FUSED[name](**kwargs), OPTAX[name](**kwargs)

  @jax.jit
  def steps(starts):
    out = []
    for (_, _, objective), carry in zip(runs, starts):
      def step(carry, _, objective=objective):
        params, s1, s2 = carry
        g = conj_grad(objective, params)
        u, s1 = fused.update(g, s1, params)
        w, s2 = reference.update(g, s2, params)
        return (optax.apply_updates(params, w), s1, s2), (u, w)
      out.append(lax.scan(step, carry, length=10)[1])
    return out

  results = steps([(p, fused.init(p), reference.init(p)) for p, _, _ in runs])
  for (got, want), (target, dtype) in zip(results, PROBLEMS):
    got, want = np.asarray(got), np.asarray(want)
    scale = np.max(np.abs(want), axis=1, keepdims=True)
    assert np.all(np.abs(got - want) <= 1e-5 * scale), (
        f"{target.__name__} {jnp.dtype(dtype).name}: max relative error "
        f"{np.max(np.abs(got - want) / scale)}")


def test_fused_sgd_under_inject_hyperparams_needs_no_params_like_optax_sgd():
  """inject_hyperparams turns every numeric default into an array; weight decay's default must
  stay 'none' there, so `update(g, state)` runs without params, as optax.sgd's does."""
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  grads = jax.tree.map(lambda p: 0.5 * p + 1.0, params)
  for face in ("pytree", "flat"):
    layout = sj.FlatLayout.from_tree(params) if face == "flat" else None
    g = layout.ravel(grads) if layout else grads
    ours = optax.inject_hyperparams(sj.fused_sgd)(learning_rate=0.1, momentum=0.9, layout=layout)
    want = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    p0 = layout.ravel(params) if layout else params
    got, _ = ours.update(g, ours.init(p0))  # no params
    ref, _ = want.update(grads, want.init(params))
    got = layout.unravel(got) if layout else got
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
