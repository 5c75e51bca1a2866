"""Secure aggregation on Flower: the server side of SecAgg+ (Bell, Bonawitz, Gascon, Lepoint,
Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020; SecAgg:
Bonawitz et al., CCS 2017) for Flower's own client mod ``flwr.clientapp.mod.secaggplus_mod``
(``secure_aggregation.enabled``).

Why not Flower's ``SecAggPlusWorkflow``: it drives a legacy ``Strategy`` through a
``LegacyContext`` (``configure_fit`` with client proxies, ``aggregate_fit`` with ``FitRes``),
divides by the total weight itself and waits 3 s between pulls. This transport speaks the same
messages to the same mod (its stages, keys and arithmetic are Flower's: ``Key``, ``Stage``,
``combine_shares``, ``pseudo_rand_gen``, ``dequantize``), inside fedtune's round loop, and hands
the strategy the *sum* and the total weight (:class:`~fedtune.protocol.strategy.SecureSum`); the
strategy divides.

A training exchange of m sampled clients (one client per Flower node: the mod's keys and state are
a node's) is four exchanges, all of message type "train":

0. setup: the protocol's parameters; each client answers two public keys;
1. share keys: each client gets its neighbours' public keys (a ring of ``secure_aggregation.num_shares``,
   seeded by (seed, round, attempt)) and answers Shamir shares of its mask seed b_i and of its
   secret key, encrypted for each neighbour;
2. collect: the fedtune request (the global arrays) plus the forwarded shares; the ClientApp
   trains and replies as always, its arrays turned into the vector Delta_i of the request's
   ``secure_layout`` (:meth:`fedtune.protocol.client.Client.secure_vector`: the update, or the
   form the method sums), and the mod replaces them by the masked vector
   [q(w_i), q(w_i/W Delta_i) + PRG(b_i) +- sum_j PRG(s_ij)] mod M (W: the round's largest
   weight, q: stochastic quantization of [-c, c] to 0..T). The round loop validates each reply's
   metadata (sender, round, ``num_examples``, ...) here; the arrays it cannot see;
3. unmask (:meth:`SecAggPlusTransport.unmask`, after validation): the clients whose replies were
   valid send shares of b_i of each summed neighbour and of the secret key of each neighbour that
   shared keys but is not summed (it dropped, or its reply was rejected); the server rebuilds
   those, removes every mask and dequantizes: sum_i w_i Delta_i and sum_i w_i.

Quantization error: stochastic rounding moves each client's coordinate by less than one step
2c/T, so each coordinate of the sum sum_i w_i Delta_i is within k (2c/T) W of the exact one (k
summed clients; ``SecureSum.error``), provided |w_i/W Delta_i| <= c (larger values are clipped
to c by the mod). m T must stay below M (checked by the config for the expected m; a round
whose DP Poisson sample is larger quantizes with T = (M - 1) // m instead, its error so stated).
Under DP the rounding draws from secret OS entropy (:func:`.clientapp.rounding_seed`) and a client
clips its vector to C minus the rounding's worst lift s sqrt(d), s the coarsest step of any round
(:meth:`fedtune.methods.base.privacy.SecureCentralGaussian.secure_release`), so its quantized
vector stays within C and the sum's sensitivity is the 2C the accountant assumes.

Bytes: the accounted bytes of a client are its fedtune messages' ``Message.nbytes`` (the request's
arrays down; the reply's metadata up: its arrays do not cross) plus the SecAgg+ payload both ways
(:func:`secagg_nbytes`: keys, encrypted shares, masked vectors as ``np.save`` bytes, node-id
lists), which is what crosses; Flower's framing is not counted, as everywhere.

What the server learns: the sum, the total weight, each client's metadata (``num_examples``,
``train_loss``, ``steps``). A client's masked weight is its own claim: the server cannot check a
single update or weight (that is the point), only the sum's shapes and finiteness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord, RecordDict
from flwr.app import Message as FlowerMessage
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedtune.config import ConfigError
from fedtune.engines.flower.codec import ATTEMPT, CID, RECORD, ROUND, format_clients, pack
from fedtune.engines.flower.transport import GridTransport, exchange
from fedtune.engines.rounds import TRAIN, Delivery
from fedtune.protocol.messages import Message
from fedtune.protocol.strategy import SECURE_LAYOUT, SECURE_MAX_WEIGHT, SecureSum

#: What a malformed SecAgg+ reply raises while it is read (a missing key, a wrong type, bytes that
#: are no array or share): that client's drop, never the run's crash.
MALFORMED = (KeyError, TypeError, ValueError, IndexError, OSError, EOFError)


def secagg_nbytes(record: Mapping[str, Any]) -> int:
    """Bytes of a SecAgg+ ConfigRecord's payload ``record``: bytes and strings by length, numbers 8 each,
    lists summed."""

    def size(value: Any) -> int:
        if isinstance(value, (bytes, str)):
            return len(value)
        if isinstance(value, list):
            return sum(size(v) for v in value)
        return 8

    return sum(size(v) for v in record.values())


@dataclass
class _Round:
    """One training exchange's protocol state, passed from stage to stage (setup, share keys,
    collect) and kept, under its (round, attempt), for its unmask stage."""

    rnd: int
    attempt: int
    cid_of: dict[int, int]  # node id -> client id
    neighbours: dict[int, set[int]]  # node id -> its neighbours' node ids (itself included)
    threshold: int  # shares that rebuild a secret in this round
    target: int  # this round's quantization range T (m T below M for this round's m clients)
    public_keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    keyed: set[int] = field(default_factory=set)  # nodes whose shares went out (stage 1 done)
    masked: dict[int, list[np.ndarray]] = field(default_factory=dict)  # node id -> masked vector
    max_weight: float = 1.0
    layout: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # the summed vector's names, shapes
    forward: dict[int, tuple[list[int], list[bytes]]] = field(default_factory=dict)  # node -> (sources, shares)
    down: dict[int, int] = field(default_factory=dict)  # node id -> SecAgg+ and fedtune bytes sent to it
    up: dict[int, int] = field(default_factory=dict)  # node id -> SecAgg+ bytes it sent
    errors: dict[int, str] = field(default_factory=dict)  # node id -> why it dropped (its first failed stage)


Parse = Callable[[int, FlowerMessage, ConfigRecord], None]  # a stage's reading of one node's reply


class SecAggPlusTransport(GridTransport):
    """:class:`GridTransport` whose training exchange runs SecAgg+ (see the module docstring);
    every other exchange (evaluation) is :class:`GridTransport`'s. ``grid``, ``node_of`` (client id ->
    node id, one client per node), ``timeout``, ``request_config``: as :class:`GridTransport`'s;
    ``config``: the run's (its ``[secure_aggregation]`` and sample size); ``seed``: the run's (the ring).

    Each stage is a method that takes the exchange's :class:`_Round` and returns what the next
    needs; the training exchange's state waits for :meth:`unmask` under its (round, attempt), the
    only one kept (a later exchange replaces it)."""

    def __init__(
        self,
        grid: Grid,
        node_of: dict[int, int],
        config: Any,
        seed: int,
        timeout: float | None = None,
        request_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(grid, node_of, timeout, request_config, None, bundle=False)
        shared = sorted(n for n, count in Counter(node_of.values()).items() if count > 1)
        if shared:
            clients = format_clients(c for c, n in node_of.items() if n == shared[0])
            raise ConfigError(
                f"secure_aggregation.enabled: Flower node {shared[0]} plays clients {clients}; SecAgg+ needs "
                "one client per node (its keys and state are a node's)"
            )
        self.secure, self.sampled, self.seed = config.secure_aggregation, config.federation.sample_size(), seed
        self.clip, self.M = float(self.secure.clipping_range), self.secure.modulus_range
        self._pending: dict[tuple[int, int], _Round] = {}

    def _send(self, stage_of: dict[int, RecordDict], rnd: int) -> dict[int, FlowerMessage]:
        """Push one content per node (as "train") and pull the replies: node id -> reply."""
        out = [
            FlowerMessage(c, dst_node_id=nid, message_type="train", group_id=str(rnd)) for nid, c in stage_of.items()
        ]
        ids, replies = exchange(self.grid, out, self.timeout, standby=self.standby)
        node_of_id = dict(zip(ids, stage_of))
        return {
            node_of_id[r.metadata.reply_to_message_id]: r
            for r in replies
            if r.metadata.reply_to_message_id in node_of_id
        }

    def _stage(
        self, state: _Round, configs: dict[int, dict[str, Any]], bytes_down: dict[int, int]
    ) -> dict[int, FlowerMessage]:
        """Send each node its SecAgg+ config (plus fedtune's envelope naming its client); the
        replies without an error (node id -> reply)."""
        contents = {}
        for nid, config in configs.items():
            bytes_down[nid] += secagg_nbytes(config)
            envelope = ConfigRecord({CID: state.cid_of[nid], ROUND: state.rnd, ATTEMPT: state.attempt})
            contents[nid] = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(dict(config)), RECORD: envelope})
        return self._send(contents, state.rnd)

    def __call__(self, kind: str, rnd: int, messages: dict[int, Message], attempt: int = 0) -> dict[int, Delivery]:
        if kind != TRAIN or not messages:
            return super().__call__(kind, rnd, messages, attempt)
        state = self._open(rnd, attempt, messages)
        self._pending = {(rnd, attempt): state}
        self._setup(state)
        self._share_keys(state)
        deliveries = self._collect(state, messages)
        out = {}
        for cid in messages:
            nid = self.node_of[cid]
            got = deliveries.get(cid) or Delivery(None, 0, error=state.errors.get(nid, "no reply"))
            got.down, got.up = state.down[nid], state.up[nid] + got.up
            out[cid] = got
        return out

    def _open(self, rnd: int, attempt: int, messages: dict[int, Message]) -> _Round:
        """The state of training exchange ``rnd`` (try ``attempt``) of ``messages``' clients: the
        ring of neighbours (seeded by (seed, round, attempt)), the threshold, the quantization range."""
        order = [self.node_of[cid] for cid in messages]
        m = len(order)
        ring = [order[i] for i in np.random.default_rng([self.seed, rnd, attempt, 0x5EC]).permutation(m)]
        half = self.secure.shares(self.sampled) >> 1
        neighbours = {nid: {ring[(i + o) % m] for o in range(-half, half + 1)} for i, nid in enumerate(ring)}
        shares = max(len(v) for v in neighbours.values())
        threshold = self.secure.reconstruction_threshold(shares)  # of this round's shares
        max_weight, layout = _secure_request(messages)
        target = self.secure.target(m)  # a DP round's Poisson sample may exceed the expected m
        cid_of = {self.node_of[cid]: cid for cid in messages}
        state = _Round(rnd, attempt, cid_of, neighbours, threshold, target, max_weight=max_weight, layout=layout)
        state.down, state.up = dict.fromkeys(order, 0), dict.fromkeys(order, 0)
        return state

    def _answered(
        self, state: _Round, replies: dict[int, FlowerMessage], stage: str, expected: set[int], parse: Parse
    ) -> None:
        """``parse(nid, reply, record)`` for each expected node's reply; a missing, failed or
        malformed one (untrusted: anything ``parse`` rejects) is that client's drop (``state.errors``)."""
        for nid in sorted(expected):
            reply = replies.get(nid)
            if reply is None:
                state.errors.setdefault(nid, f"{stage}: no reply within {self.timeout} s")
            elif reply.has_error():
                state.errors.setdefault(nid, f"{stage}: client error: {reply.error.reason}")
            elif RECORD_KEY_CONFIGS not in reply.content.config_records:
                state.errors.setdefault(nid, f"{stage}: no {RECORD_KEY_CONFIGS!r} record in the reply")
            else:
                record = reply.content.config_records[RECORD_KEY_CONFIGS]
                state.up[nid] += secagg_nbytes(record)
                try:
                    parse(nid, reply, record)
                except MALFORMED as exc:
                    state.errors.setdefault(nid, f"{stage}: malformed reply ({type(exc).__name__}: {exc})")

    def _setup(self, state: _Round) -> None:
        """Stage 0: the protocol's parameters to every node; each answers two public keys
        (``state.public_keys``)."""
        order = list(state.down)
        setup = {
            Key.STAGE: Stage.SETUP,
            Key.SAMPLE_NUMBER: len(order),
            Key.SHARE_NUMBER: max(len(v) for v in state.neighbours.values()),
            Key.THRESHOLD: state.threshold,
            Key.CLIPPING_RANGE: self.clip,
            Key.TARGET_RANGE: state.target,
            Key.MOD_RANGE: self.M,
            Key.MAX_WEIGHT: state.max_weight,
        }
        replies = self._stage(state, dict.fromkeys(order, setup), state.down)
        self._answered(state, replies, "setup", set(order), partial(_read_public_keys, state))

    def _share_keys(self, state: _Round) -> None:
        """Stage 1: each node that sent its keys gets its neighbours' and answers its encrypted
        shares, kept for forwarding in stage 2 (``state.forward``; the senders in ``state.keyed``)."""
        active = set(state.public_keys)
        configs: dict[int, dict[str, Any]] = {}
        for nid in active:
            config: dict[str, Any] = {str(n): list(state.public_keys[n]) for n in state.neighbours[nid] & active}
            configs[nid] = {**config, Key.STAGE: Stage.SHARE_KEYS}
        state.forward = {nid: ([], []) for nid in active}
        replies = self._stage(state, configs, state.down)
        self._answered(state, replies, "share keys", active, partial(_read_key_shares, state))

    def _collect(self, state: _Round, messages: dict[int, Message]) -> dict[int, Delivery]:
        """Stage 2: each keyed node gets its fedtune request plus the shares forwarded to it and
        answers the masked vector (``state.masked``) with the reply's metadata: client id -> its
        delivery (the arrays left out)."""
        contents = {}
        for nid in state.keyed:
            cid = state.cid_of[nid]
            sources, ciphertexts = state.forward[nid]
            srcs = [s for s in sources if s in state.keyed]
            ctxts = [c for s, c in zip(sources, ciphertexts, strict=True) if s in state.keyed]
            config: dict[str, Any] = {
                Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                Key.CIPHERTEXT_LIST: ctxts,
                Key.SOURCE_LIST: srcs,
            }
            scalars: dict[str, Any] = {ROUND: state.rnd, ATTEMPT: state.attempt, **self.setting(cid)}
            content, nbytes = pack(messages[cid], cid, **scalars)
            content[RECORD_KEY_CONFIGS] = ConfigRecord(config)
            contents[nid] = content
            state.down[nid] += nbytes + secagg_nbytes(config)
        deliveries: dict[int, Delivery] = {}
        read = partial(self._read_masked, state, messages, deliveries)
        self._answered(state, self._send(contents, state.rnd), "collect", set(contents), read)
        return deliveries

    def _read_masked(
        self,
        state: _Round,
        messages: dict[int, Message],
        deliveries: dict[int, Delivery],
        nid: int,
        reply: FlowerMessage,
        record: ConfigRecord,
    ) -> None:
        """Node ``nid``'s collect reply: its delivery (metadata) into ``deliveries`` and, when it
        has a reply, its masked vector into ``state.masked`` (integers shaped as the layout)."""
        shapes = [(1,), *(shape for _, shape in state.layout)]
        got = self._delivery(reply, state.cid_of[nid], "", messages[state.cid_of[nid]], 0, {})
        if got.reply is not None:
            vector = [bytes_to_ndarray(b) for b in _byte_strings(record[Key.MASKED_PARAMETERS])]
            if [np.shape(v) for v in vector] != shapes or any(v.dtype.kind not in "iu" for v in vector):
                raise ValueError("the masked vector is not integers shaped as the request's secure_layout")
            state.masked[nid] = vector
            got.masked = True
        deliveries[state.cid_of[nid]] = got

    def unmask(
        self, rnd: int, attempt: int, client_ids: list[int], sent: dict[int, Message]
    ) -> tuple[SecureSum | None, dict[int, Delivery]]:
        """Stage 3: the sum of the masked updates of ``client_ids`` (the valid replies of this
        round's training exchange ``rnd``, try ``attempt``, whose requests were ``sent``), every other
        mask removed; None when a secret cannot be rebuilt (fewer than the round's threshold of shares)."""
        state = self._pending.pop((rnd, attempt), None)
        if state is None:
            raise RuntimeError(f"unmask of round {rnd} (attempt {attempt}) without its training exchange")
        summed = {self.node_of[cid] for cid in client_ids if self.node_of[cid] in state.masked}
        dead = state.keyed - summed  # their pairwise masks are in the summed vectors: rebuilt from their key
        down, up = dict.fromkeys(summed, 0), dict.fromkeys(summed, 0)
        collected, errors = self._unmask_shares(state, summed, dead, down, up)
        short = sorted(state.cid_of[n] for n, shares in collected.items() if len(shares) < state.threshold)
        total, why = None, f"secure aggregation: fewer than {state.threshold} shares for clients {short}"
        if summed and not short:
            try:
                total = self._sum(state, summed, collected, [name for name, _ in state.layout])
            except (*MALFORMED, AssertionError) as exc:  # a share that rebuilds no key or seed
                why = f"secure aggregation: a secret did not rebuild from its shares ({type(exc).__name__})"
        deliveries = {}
        for nid in summed:  # a failed unmask reply drops nobody when the others' shares sufficed
            error = None if total is not None else errors.get(nid, why)
            deliveries[state.cid_of[nid]] = Delivery(None, down[nid], up[nid], error=error)
        return total, deliveries

    def _unmask_shares(
        self, state: _Round, summed: set[int], dead: set[int], down: dict[int, int], up: dict[int, int]
    ) -> tuple[dict[int, list[bytes]], dict[int, str]]:
        """Ask each ``summed`` node for its shares of its summed neighbours' b_i and of its
        ``dead`` neighbours' secret keys: owner node -> the shares collected (from its neighbours
        only), and node -> why its reply was unusable. Bytes go to ``down`` / ``up``."""
        configs = {
            nid: {
                Key.STAGE: Stage.UNMASK,
                Key.ACTIVE_NODE_ID_LIST: sorted(state.neighbours[nid] & summed),
                Key.DEAD_NODE_ID_LIST: sorted(state.neighbours[nid] & dead),
            }
            for nid in summed
        }
        replies = self._stage(state, configs, down)
        collected: dict[int, list[bytes]] = {nid: [] for nid in summed | dead}
        errors = {}
        for nid in summed:
            reply = replies.get(nid)
            try:
                if reply is None or reply.has_error():
                    raise ValueError("no reply" if reply is None else f"client error: {reply.error.reason}")
                record = reply.content.config_records[RECORD_KEY_CONFIGS]
                up[nid] += secagg_nbytes(record)
                owners = cast(list[int], record[Key.NODE_ID_LIST])  # for the checker: still untrusted
                pairs = list(zip(owners, _byte_strings(record[Key.SHARE_LIST]), strict=True))
            except MALFORMED as exc:
                errors[nid] = f"{type(exc).__name__}: {exc}"
                continue
            for owner, share in pairs:
                if owner in collected and owner in state.neighbours[nid]:
                    collected[owner].append(share)
        return collected, errors

    def _sum(self, state: _Round, summed: set[int], collected: dict[int, list[bytes]], names: list[str]) -> SecureSum:
        """The masks removed from the summed vectors (Flower's ``SecAggPlusWorkflow.unmask_stage``
        arithmetic) and the sum dequantized; raises when a secret does not rebuild from its shares."""
        shapes = [np.shape(v) for v in next(iter(state.masked.values()))]
        vector = [sum(state.masked[n][i].astype(np.int64) for n in summed) for i in range(len(shapes))]
        for nid, shares in collected.items():
            secret = combine_shares(shares)
            if nid in summed:  # its own mask b_i
                vector = [v - p for v, p in zip(vector, pseudo_rand_gen(secret, self.M, shapes), strict=True)]
                continue
            private = bytes_to_private_key(secret)
            for other in state.neighbours[nid] & summed:  # the pairwise masks it shared with summed clients
                key = generate_shared_key(private, bytes_to_public_key(state.public_keys[other][0]))
                mask = pseudo_rand_gen(key, self.M, shapes)
                sign = 1 if nid > other else -1  # the summed client subtracted (nid > other) or added it
                vector = [v + sign * p for v, p in zip(vector, mask, strict=True)]
        reduced = [np.asarray(v) & (self.M - 1) for v in vector]
        factor, rest = int(reduced[0].reshape(-1)[0]), reduced[1:]
        k = len(summed)
        values = [d - (k - 1) * self.clip for d in dequantize(rest, self.clip, state.target)]  # sum_i (w_i / W) Delta_i
        return SecureSum(
            arrays={name: v * state.max_weight for name, v in zip(names, values, strict=True)},
            weight=factor / state.target * state.max_weight,
            clients=sorted(state.cid_of[n] for n in summed),
            error=k * 2 * self.clip / state.target * state.max_weight,
        )


def _read_public_keys(state: _Round, nid: int, reply: FlowerMessage, record: ConfigRecord) -> None:
    """Node ``nid``'s setup reply: its two public keys into ``state.public_keys``."""
    first, second = _byte_strings([record[Key.PUBLIC_KEY_1], record[Key.PUBLIC_KEY_2]])
    state.public_keys[nid] = (first, second)


def _read_key_shares(state: _Round, nid: int, reply: FlowerMessage, record: ConfigRecord) -> None:
    """Node ``nid``'s share-keys reply: its encrypted shares, each for one of its neighbours,
    queued in ``state.forward`` for that neighbour; ``nid`` joins ``state.keyed``."""
    destinations = cast(list[int], record[Key.DESTINATION_LIST])  # for the checker: still untrusted
    pairs = list(zip(destinations, _byte_strings(record[Key.CIPHERTEXT_LIST]), strict=True))
    if any(dst not in state.neighbours[nid] for dst, _ in pairs):
        raise ValueError("shares for a node that is not its neighbour")
    state.keyed.add(nid)
    for dst, ciphertext in pairs:
        if dst in state.forward:
            state.forward[dst][0].append(nid)
            state.forward[dst][1].append(ciphertext)


def _byte_strings(values: Any) -> list[bytes]:
    """``values`` when it is a list of byte strings (a reply's keys, shares, vectors), else TypeError."""
    if not isinstance(values, list) or not all(isinstance(v, bytes) for v in values):
        raise TypeError("expected a list of bytes")
    return values


def _secure_request(messages: dict[int, Message]) -> tuple[float, list[tuple[str, tuple[int, ...]]]]:
    """The round's largest client weight W (``secure_max_weight``) and the summed vector's layout
    (``secure_layout``: names and shapes), the same in every request of the strategy's round."""
    weights = {float(m.meta.get(SECURE_MAX_WEIGHT, 0)) for m in messages.values()}
    layouts = {
        tuple((str(k), tuple(int(d) for d in shape)) for k, shape in m.meta.get(SECURE_LAYOUT, ()))
        for m in messages.values()
    }
    if len(weights) != 1 or not next(iter(weights)) > 0 or len(layouts) != 1 or not next(iter(layouts)):
        raise ValueError(
            "secure aggregation needs in every request the same positive secure_max_weight and secure_layout "
            "(a weighted-sum method's request)"
        )
    return weights.pop(), list(layouts.pop())
