"""CoMMIT (coordinated multimodal instruction tuning): :mod:`.commit` registers ``commit`` (its
strategy, client and options); :mod:`.balance` holds the paper's equations (kappa of eq. 3, the
eq. 6 scheduler, the eqs. 7-8 regularizer, the coordinate-descent baselines).
"""

from fedtune.methods.commit import commit  # noqa: F401  (registration)
