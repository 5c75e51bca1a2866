"""Experiment trackers (``[logging] to = ["tensorboard", "mlflow", "wandb"]``): each round's
``metrics.jsonl`` line, the resolved config as hyperparameters, the plan's per-client figures and
the summary, written to TensorBoard (event files in ``RUN/tensorboard``), MLflow (a local store:
``sqlite:///RUN/mlflow.db`` by default; the adapter and the run's files as artifacts) or W&B
(offline into ``RUN/wandb`` when no API key is set; ``wandb sync`` uploads it later).

The interface is :class:`~fedtune.tracking.base.Tracker`; :class:`~fedtune.tracking.base.Trackers`
drives those a run names. The packages are the ``tracking`` extra (``pip install
'fedtune[tracking]'``); a run that names a tracker whose package is missing stops in one line
before anything is written (:func:`check_installed`).
"""

from __future__ import annotations

from fedtune.tracking.base import PACKAGES, TRACKERS, Tracker, Trackers, check_installed, tracker_class

__all__ = ["PACKAGES", "TRACKERS", "Tracker", "Trackers", "check_installed", "tracker_class"]
