"""The same Strategy and Client objects as a Flower ServerApp / ClientApp (flwr Message API).

What crosses. A fedtune :class:`~fedtune.protocol.messages.Message` travels as Flower-native
records, one ArrayRecord and one ConfigRecord (the shape Flower's mods expect)::

    RecordDict {
      "fedtune-arrays": ArrayRecord {dtype: Array(...), ...}    # Message.arrays, one Array per dtype
      "fedtune": ConfigRecord {
        "meta": JSON of Message.meta,                           # the fedtune metadata
        "layout": JSON [[name, dtype, shape], ...],             # the arrays in the Arrays (.packing)
        "cid": client id, "round": r,                           # who and when (both ways)
        "attempt": a,                                           # request: the round's attempt
        "compute_s": s,                                         # reply: seconds of the Client call (not private)
        "clipping_norm": C, "update-as-weights": True,          # request, only with DP clipping
      }
    }

The arrays keep their names, dtypes and shapes; ``Message(arrays, json.loads(meta))`` on the other
side is the message that was sent (tests/test_flower.py round-trips it through Flower's
protobuf serialization). One Array per dtype, not per tensor: Flower moves each Array as objects
of its own, one request per hop.

How bytes are counted. The bytes a run reports are ``Message.nbytes`` of each message, the
length of fedtune's own encoding of the same arrays and meta (magic, JSON header, raw array
bytes), exactly as the embedded engine counts them (there ``len(message.encode())``); so both
engines report the same numbers for the same run. The transport scalars of the ConfigRecord
and Flower's own framing (protobuf, per-Array ``np.save`` headers, object ids, HTTP) are not
counted: they are Flower's cost, not the method's, and differ between Flower versions.

Nodes and clients. A node plays the client ids in its ``node_config``: ``partition-id`` (one
client, Flower's convention; the simulation numbers its nodes ``0..N-1``) or ``fedtune-clients``
(a group, ``"0-99"`` or ``"0,5,7-9"``), so 1,000 clients need not be 1,000 SuperNodes. The
server asks every node once (a ``query`` message) which clients it plays and checks that each
client id 0..N-1 is played by exactly one node. Each request names its client id; a node
refuses a client it does not play. A client's persistent state (``Client.state``) lives in its
node's ``context.state`` (one ArrayRecord per client id).

Rounds. The round loop is every engine's (:func:`~fedtune.engines.rounds.drive_rounds`), with a
batched transport (:class:`GridTransport`): all messages of a round are pushed at once, so nodes
train in parallel, replies are pulled every :data:`POLL_S` seconds (Flower's
``send_and_receive`` sleeps 3 s between pulls) and put back in the order of ``configure_fit``
(aggregation order fixes float sums). A node playing several of an exchange's clients gets them
as one *bundle* (one Flower message: each client's two records with the keys suffixed
``-<cid>``, plus a ``fedtune-bundle`` ConfigRecord listing the clients), served one after
another by one ClientApp process; a client failing inside a bundle is named in the reply's
bundle record and dropped alone. Requests for Flower's clipping mod are never bundled (the mod
wants one ArrayRecord per message). A reply carrying an error, or none within the deadline, is a
drop. The ClientApp times each Client call and returns the seconds as ``compute_s``, except
under local DP or SecAgg+, where a reply carries nothing of the client but the method's fields
(:func:`.codec.sends_compute_s`: the node then enforces the deadlines itself); the timing file
``flower_timing.jsonl`` is written only without DP and SecAgg+ (:func:`.codec.keeps_timing`).

Deployment. Stock Flower starts a fresh ``flwr-clientapp`` process per message (importing torch,
transformers and PEFT and loading the model there takes seconds). A fedtune SuperNode runs with
``--isolation process`` instead and its long-lived executor (:mod:`.executor`) claims each message's
task from the SuperNode's Runtime API and runs this module's ClientApp in place, the task's model
and data kept warm; the loopback deployment's ServerApp runs in the ``fedtune run`` process
(:mod:`.inprocess`), and standby messages keep idle SuperNodes from Flower's 3 s idle sleep
(:mod:`.standby`). Without an executor (the simulation, a SuperNode started by hand) the ClientApp
trains in its own process; the tokenized data then comes from the on-disk cache
(:mod:`fedtune.data.cache`). ``node_config["fedtune-threads"]`` sets the torch threads of a
node's training (default of the deployments: cores / nodes).

Differential privacy. Flower's client-side ``fixedclipping_mod`` clips ``reply - request`` of the
single ArrayRecord and needs ``clipping_norm`` in the request's single ConfigRecord; fedtune
clients reply with *updates* (trained - received), so with ``clipping_norm`` set
(:class:`GridTransport` ``request_config``, or ``clipping-norm`` in Flower's run config) a
request also carries ``update-as-weights``: the ClientApp returns received + update, the mod
clips it, and the server takes ``reply - request`` back. :data:`client_app` applies the mod only
to requests that carry a clipping norm (:func:`only_when_clipping`). fedtune's own DP-FedAvg
(``[privacy]``, :mod:`fedtune.methods.base.privacy`) needs nothing of the engine: the strategy
noises the sum (central) and the clients their uploads (local), as on the embedded engine.

Secure aggregation. With ``secure_aggregation.enabled`` the training exchange runs SecAgg+
(:mod:`.secagg`): Flower's ``secaggplus_mod`` on every ClientApp (:func:`only_when_secure`,
only for requests carrying its config record), fedtune's server stages in the round loop; the
strategy gets the sum of the clients' weighted vectors (their updates, or the form the method
sums: :meth:`~fedtune.methods.base.aggregation.Aggregation.secure_mean`) and the total weight
(:class:`~fedtune.protocol.strategy.SecureSum`), never an update.

Usage::

    from fedtune.engines.flower.simulation import run_flower_simulation
    summary = run_flower_simulation(load_config("configs/fedit.toml"))   # Ray, one node per client
    # a loopback deployment: fedtune run RECIPE --set engine=flower (fedtune.engines.flower.deployment)
"""

from __future__ import annotations
