"""Named recipes: a config's `recipe` key sets the keys a published recipe ties together, from
the run's own length, so that the recipe holds on a data set of any size.

`validate` applies the recipe after every other key (the config file, `--set`), so a recipe's
phases follow `num_epochs` as finally set. The keys a recipe sets are its own: values set for
them elsewhere are replaced (the summary's config shows what ran).

  onebit_adam   1-bit Adam (Tang et al., ICML 2021) on a sparse exchange: the exchange's dense
                form for the first eighth of the run, AdamW's second moment frozen from the same
                step (Adam is then linear in the gradients, as error feedback needs), then the
                configured sparse algorithm with error feedback and no density warm-up. Sets
                `compression.dense_epochs` and `optimizer.freeze_variance_epochs` to
                `num_epochs / 8` and `compression.warmup_epochs` to 0; needs optimizer adamw
                without momentum correction. Once frozen, each coordinate's Adam direction is
                clipped to the bound it had while the variance ran (`optim.frozen_bound`). On
                the KJV LM task (docs/time-to-accuracy-lm.md) it reaches dense's loss target at
                dense's step with HiTopKComm 0.1.
"""

from __future__ import annotations

from typing import Any

__all__ = ["apply", "onebit_adam", "ONEBIT_DENSE_FRACTION"]

ONEBIT_DENSE_FRACTION = 0.125  # 1-bit Adam's dense start: the first eighth of the run


def onebit_adam(config: Any) -> Any:
  """`config` (a ConfigDict, changed in place and returned) with 1-bit Adam's phases."""
  if config.optimizer.name != "adamw" or config.compression.momentum_correction:
    raise ValueError(
        f"recipe 'onebit_adam' needs optimizer.name 'adamw' without "
        f"compression.momentum_correction, got optimizer.name {config.optimizer.name!r}, "
        f"compression.momentum_correction {config.compression.momentum_correction!r}")
  start = ONEBIT_DENSE_FRACTION * config.num_epochs
  config.compression.dense_epochs = start
  config.optimizer.freeze_variance_epochs = start
  config.compression.warmup_epochs = 0.0
  return config


_RECIPES = {"onebit_adam": onebit_adam}


def apply(config: Any) -> Any:
  """`config` with its `recipe` applied (unchanged for recipe "")."""
  if not config.recipe:
    return config
  if config.recipe not in _RECIPES:
    raise ValueError(f"config key 'recipe' = {config.recipe!r}: must be one of "
                     f"{', '.join(repr(r) for r in ('', *_RECIPES))}")
  return _RECIPES[config.recipe](config)
