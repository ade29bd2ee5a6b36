"""The main job: mesh, train state, sharded steps, loop, checkpoints, metrics, configs."""

from sparsejax.train.config import apply_overrides, default_config, load_config, validate
from sparsejax.train.loop import TooManySkippedSteps, train_and_evaluate
from sparsejax.train.mesh import make_mesh
from sparsejax.train.step import Trainer, TrainState

__all__ = ["apply_overrides", "default_config", "load_config", "validate", "train_and_evaluate",
           "TooManySkippedSteps", "make_mesh", "Trainer", "TrainState"]
