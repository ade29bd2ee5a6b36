"""`compression.algorithm = "auto"`: the exchange chosen on the host, by measurement.

The compressor is `auto.sparse` built with its dense form (`density_schedule(...,
dense_form=True)`): one state, two forms, so a switch loses nothing (a dense step sends the
residual).
`AutoExchange` picks the form before a step, at the first step and again whenever the last
measurement's cost allows (`auto.probe_budget`: the measurements take at most that share of the
run's time, `probe_interval`). No figure comes from the user or from another task: each
measurement reads, from the run itself (every process the same probes, each figure the slowest
process's, so all processes choose alike):

  the step  the whole train step of a form, as the run takes it: at the first measurement
            both forms' compiled steps timed on a copy of the state; later the form in force,
            observed over the steps since the last measurement (evaluations and checkpoints
            left out; a window restarts where the level changes); at a new input size
            (progressive resizing) the form in force timed there and the other's step moved
            by the same change (only the forward and backward pass depends on the input);
  link      an all-reduce over the "node" axis at 4 KiB, 64 KiB and, on a fast link, at a size
            that takes about 20 ms (at most a worker's shard): a fixed cost per call and a
            bandwidth (`fit_link`);
  gradient  one forward and backward pass for the spread of each node's gradient,
            ||g||_1^2 / (n ||g||_2^2) (1 for a flat gradient, 1/n for a single value),
            averaged over the nodes; only where the lag could raise the sparse form's factor
            above `auto.min_step_factor` (`spread_matters`), else not run;
  select    the sparse form's local work on one shard at its final k: MSTopK with error feedback
            and the scatter-add of every node's pairs.

`predict` moves each form's step to the link measured now with the library's cost model
(`sparsejax.cost.exchange_time`): the form's step when last measured less its modelled exchange
then, plus its modelled exchange now; the form just measured as measured. `choose` then weighs
the forms' time over the rest of the run:
error feedback sends each value late, so the sparse form's model lags the dense one's by about
`lag_steps` = spread / (2 density) steps (a value whose share of the gradient's L1 norm is s
waits about 1 / (2 k s) steps for its turn in the top k); the sparse form costs (remaining steps
+ lag) x its step against remaining x the dense step, and the form in force is kept unless the
other is faster by more than `auto.margin`. Where the user knows the sparse form's steps to the
target over dense's, `auto.step_factor` replaces the lag. Not modelled: the density warm-up's
higher levels (their steps cost more than the final density's) and any overlap of the exchange
with compute (the step runs them in sequence).

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
                                        Link,
                                        Measurement,
                                        choose,
                                        exchange_s,
                                        faster,
                                        fit_in_steps,
                                        fit_link,
                                        lag_steps,
                                        measuring,
                                        moved_window,
                                        predict,
                                        probe_interval,
                                        rests,
                                        spread_matters,
                                        stale,
                                        step_factor,
                                        with_run_costs,
)
from sparsejax.train.auto.probes import large_probe_size

__all__ = ["Link", "Measurement", "fit_link", "exchange_s", "predict", "rests", "with_run_costs",
           "fit_in_steps", "faster", "moved_window", "stale", "large_probe_size",
           "lag_steps", "spread_matters", "step_factor", "choose", "probe_interval",
           "measuring", "AutoExchange", "describe", "FORMS"]
