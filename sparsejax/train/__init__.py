"""The main job: the run plan, one `Run` (mesh, train state, compiled steps), the loop,
checkpoints, metrics, configs."""

from sparsejax.train.checkpoint import CheckpointError
from sparsejax.train.config import apply_overrides, default_config, load_config, validate
from sparsejax.train.loop import TooManySkippedSteps, train_and_evaluate
from sparsejax.train.mesh import make_mesh
from sparsejax.train.optimizer import build_optimizer
from sparsejax.train.plan import Plan, make_plan, steps
from sparsejax.train.run import Run, evaluate
from sparsejax.train.state import TrainSetup, TrainState, create_train_state, from_config
from sparsejax.train.step import eval_step, jit_eval_step, jit_train_step, train_step

__all__ = ["apply_overrides", "default_config", "load_config", "validate", "train_and_evaluate",
           "TooManySkippedSteps", "CheckpointError", "make_mesh", "build_optimizer", "Plan",
           "make_plan", "steps", "Run", "evaluate", "TrainSetup", "TrainState",
           "create_train_state", "from_config", "train_step", "eval_step", "jit_train_step",
           "jit_eval_step"]
