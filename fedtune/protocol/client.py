"""Client side of a method: the abstract Client every method implements.

A client is built fresh for each call (``fit`` or ``evaluate``) by the engine, from its id, its
resource profile and the process's run context (:class:`fedtune.runtime.RunContext`, which caches
the task's base model and data, so 1,000 registered clients do not hold 1,000 models). Clients are
stateless between rounds; a method that needs per-client memory keeps it in ``self.state``, a dict
of arrays that the engine persists per client id (Flower: the node's ``context.state``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from fedtune.config import RunConfig
from fedtune.protocol.context import ClientContext
from fedtune.protocol.messages import Message
from fedtune.protocol.profiles import ClientProfile
from fedtune.protocol.strategy import secure_layout_of


class Client(ABC):
    """Client-side logic of one method: local training and evaluation on a Message."""

    def __init__(
        self,
        cid: int,
        profile: ClientProfile,
        context: ClientContext,
        state: dict[str, np.ndarray] | None = None,
    ) -> None:
        """Client ``cid`` with its resource ``profile``, the process's run ``context`` (whose
        ``config`` and method ``options`` it keeps as attributes) and the ``state`` the engine
        persisted for it (None: empty)."""
        self.cid = cid
        self.profile = profile
        self.context = context
        self.config: RunConfig = context.config
        self.options: object = context.options  # a method declares its options class: options: MyOptions
        self.state = state if state is not None else {}

    @abstractmethod
    def fit(self, message: Message) -> Message:
        """Train locally from the server's ``message``; reply with the update and ``meta`` metrics
        (by convention ``num_examples``, ``steps``, ``train_loss``)."""

    def secure_vector(self, message: Message, reply: Message) -> dict[str, np.ndarray]:
        """Under secure aggregation: the vector v_i this client masks for the server's sum
        sum_i w_i v_i (:class:`~fedtune.protocol.strategy.SecureSum`), laid out as
        ``message.meta["secure_layout"]`` (name -> shape) asks, from its training ``reply`` to
        ``message``. Default: the reply's arrays (an update of the global arrays). A method whose
        sum needs them in another form (zero-padded to the global rank, scattered into the global
        shape, with extra entries such as per-slot weights) overrides it; its strategy's
        ``aggregate_secure_fit`` reads the sum back."""
        return dict(reply.arrays)

    def secure_reply(self, message: Message, reply: Message) -> Message:
        """``reply`` with its arrays replaced by :meth:`secure_vector`, checked against (and in the
        order of) the ``secure_layout`` of the request ``message``, bounded by :meth:`bound_secure_vector`:
        what Flower's SecAgg+ mod quantizes and masks."""
        layout = secure_layout_of(message.meta)
        vector = self.secure_vector(message, reply)
        if vector.keys() != layout.keys() or any(np.shape(vector[k]) != shape for k, shape in layout.items()):
            raise ValueError(
                f"secure aggregation: client {self.cid}'s vector {sorted(vector)[:3]} does not match the "
                f"request's secure_layout {list(layout)[:3]}"
            )
        return Message(self.bound_secure_vector({k: np.asarray(vector[k]) for k in layout}), reply.meta)

    def bound_secure_vector(self, vector: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The :meth:`secure_vector` ``vector`` as the SecAgg+ mod gets it to quantize and mask:
        default as it is; a client under a privacy mechanism bounds it here (``UpdateClient``:
        clipped so that its quantized form stays within the clip)."""
        return vector

    def phase(self, name: str, message: Message) -> Message:
        """Answer ``message`` of the round's further exchange ``name`` (:meth:`Strategy.phases`); default: none."""
        raise RuntimeError(f"{type(self).__name__} does not implement phase {name!r}")

    def evaluate(self, message: Message) -> Message:
        """Evaluate locally as ``message`` asks; reply with metrics in ``meta`` (default: not supported)."""
        raise RuntimeError(f"{type(self).__name__} does not implement federated evaluation")
