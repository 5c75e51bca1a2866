"""RABO (resource-adaptive federated bilevel optimization) and its baselines, each registering itself:

- :mod:`.rabo`: ``rabo`` (implicit hypergradients) and ``rafbo`` (finite differences) over a
  :class:`~fedtune.models.bilevel.BilevelProblem` that the task supplies;
- :mod:`.fedmbo`: ``fedmbo``, the full-model bilevel baseline;
- :mod:`.static`, :mod:`.fedrolex`, :mod:`.fiarse`: the submodel FL baselines (``static``,
  ``fedrolex``, ``fiarse``) over :mod:`.submodel`.

RABO's own maths lives here too: :mod:`.masks` (structures, submodels, covered updates),
:mod:`.hypergrad` (implicit and finite-difference hypergradients) and :mod:`fedtune.models.bilevel`
(the bilevel problem interface; the tasks supply their problems).
"""

from fedtune.methods.rabo import fedmbo, fedrolex, fiarse, rabo, static  # noqa: F401  (registration)
