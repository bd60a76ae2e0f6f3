"""Experiment trackers: every run (a ``prune``, a matrix cell) logged as one run of MLflow or Weights & Biases.

``--report-to mlflow,wandb`` (the matrix key ``report_to``, spelled as transformers spells it) names the trackers;
the JSON records stay the results, and a tracker shows them beside a user's other experiments. What a tracker run
holds is :mod:`rcpu_bench.tracking.content`, the trackers of one command :mod:`rcpu_bench.tracking.trackers`, one
module per tracker behind its small interface (:mod:`~rcpu_bench.tracking.mlflow_tracker`,
:mod:`~rcpu_bench.tracking.wandb_tracker`); each imports its library only when it logs.
"""

TRACKERS = ("mlflow", "wandb")  # the names --report-to takes
