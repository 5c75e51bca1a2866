"""BoMM's networks and the pure pieces of its algorithm (Section 4), free of any protocol code:

- :mod:`~fedtune.models.bomm.backbone`: the cloud model's frozen pretrained backbone phi, run
  where the data is (parties; the server on the public test set), with a per-process feature cache;
- :mod:`~fedtune.models.bomm.networks`: the cloud classifier psi_1, the generator psi_2 and the
  parties' adapters from phi-space into their small model's embedding space;
- :mod:`~fedtune.models.bomm.completion`: the preference-driven completion loss, eqs. (3)-(4);
- :mod:`~fedtune.models.bomm.scheduler`: the dynamic sample scheduler, eqs. (5)-(8);
- :mod:`~fedtune.models.bomm.alignment`: prototypes and global prototype-guided alignment, eq. (9).

The method itself (parties, cloud, messages) is :mod:`fedtune.methods.bomm`.
"""
