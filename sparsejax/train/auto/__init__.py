"""`compression.algorithm = "auto"`: the exchange chosen on the host, from the run's own steps.

The compressor is `auto.sparse` built with its dense form (`density_schedule(...,
dense_form=True)`): one state, two forms, so a switch loses nothing (a dense step sends the
residual). `AutoExchange` picks the form before a step, at the first step and again whenever
the measurements' cost allows (`auto.probe_budget`: they take at most that share of the
run's time, their compilations included, `probe_interval`) and once the form in force has run
a few steps at a new input size. What it reads (every process the same probes, each figure the
slowest process's, so all processes choose alike):

  the step  the form in force's steps as the run takes them between two measurements
            (evaluations and checkpoints left out; a window restarts where the level changes);
            nothing is timed on a copy and no form is run to be tried;
  link      an all-reduce over the "node" axis at 4 KiB, 64 KiB and, on a fast link, at a size
            that takes about 20 ms (at most a worker's shard): a fixed cost per call and a
            bandwidth (`fit_link`); read twice, the faster kept, before the form is switched;
  select    the sparse form's local work on one shard at its final k, probed once.

The decision model (`model`, pure): a form's step is its rest (the step less its modelled
exchange, read from the run; a form not yet run takes the other's) plus its modelled exchange on
the link read now (`sparsejax.cost.exchange_time`); the sparse form needs F times dense's steps,
F at `auto.step_factor_quantile` of the factors measured on the study's tasks (`STEP_FACTORS`) or
the user's `auto.step_factor`; the form in force is kept unless the other's time over the steps
left is shorter by more than `auto.margin` and what the switch compiles (`switch_s`: where the
other form has not run at this input size, its programs at what the run's took there). Not
modelled: the density warm-up's higher levels (their steps cost more than the final density's)
and any overlap of the exchange with compute.

`auto.schedule` fixes the forms by epoch instead (no measurement): for reproducible runs, the
tests, and the fixed schedules a study compares auto with. A schedule's "measured" entries hand
the choice back to the measurements from their epoch on. `compression.dense_epochs` runs the
dense form first whatever the link (1-bit Adam's dense start: recipe "onebit_adam"), then the
schedule or the measured form. Each choice, with the figures behind it (`describe`), is printed,
written to `auto.csv` and kept in the checkpoints' and summary.json's "exchange_choices".
"""

from __future__ import annotations

from sparsejax.train.auto.controller import AutoExchange, describe
from sparsejax.train.auto.model import (
                                        FORMS,
                                        STEP_FACTORS,
                                        Link,
                                        choose,
                                        exchange_s,
                                        faster,
                                        fit_in_steps,
                                        fit_link,
                                        lag_steps,
                                        measuring,
                                        moved,
                                        predict,
                                        probe_interval,
                                        rest_of,
                                        step_factor,
                                        switch_s,
)
from sparsejax.train.auto.probes import large_probe_size

__all__ = ["Link", "fit_link", "exchange_s", "predict", "moved", "rest_of",
           "fit_in_steps", "faster", "large_probe_size", "lag_steps", "step_factor",
           "STEP_FACTORS", "choose", "switch_s", "probe_interval", "measuring", "AutoExchange",
           "describe", "FORMS"]
