"""FedPFT (Peng et al., IJCAI 2024) and its two baselines, each registering itself:

- :mod:`.fedpft`: ``fedpft``, LoRA FL on a saliency-compressed proxy aligned by layer-level
  (before FL) and neuron-level (during FL) distillation, plugged back into the full model;
- :mod:`.fedot`: ``fedot``, Offsite-Tuning in FL (adapter layers around a layer-drop emulator);
- :mod:`.fedpetuning`: ``fedpetuning``, LoRA FL on the full model.

:mod:`.proxy` holds what FedPFT and FedOT share: the FL strategy (the proxy's download through
Messages, FedAvg of the adapter, evaluation of the full model and the proxy) and the client's
proxy store. The strategy holds two collaborators: :mod:`.construction` (the proxy built before
FL or loaded from its cache, then held; each method's construction is a ``ProxyBuilder``) and
:mod:`.alignment` (distillation from the full model on public data, before and during FL).
"""

from fedtune.methods.fedpft import fedot, fedpetuning, fedpft  # noqa: F401  (registration)
