"""Long steps report their progress here, and whoever shows it (the command line:
:class:`fedtune.progress.StepDisplay`) listens; a library user's process shows nothing.

A step is a context: ``with step("tokenizing 38,158 texts", total=38158, unit="texts") as advance:``
then ``advance(k)`` as it goes; code deeper down that does not know the step (a scoring loop)
calls :func:`advance`, which moves the innermost open step. ``scale`` converts what the inner code
counts into the step's unit (rows scored -> questions: ``total / rows``). Steps nest (loading a
base, then quantizing its layers). A step without ``total`` is a spinner with its elapsed time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")
CHUNK = 1000  # items per call of in_chunks (a progress step each)


@dataclass
class Step:
    """One long step under way: what it is, how far it has come, and what counts as done."""

    description: str
    total: float | None = None
    unit: str = ""
    scale: float = 1.0
    completed: float = 0.0
    started: float = field(default_factory=time.monotonic)
    shown: float = field(default_factory=time.monotonic)  # when a display last reported it
    handle: object = field(default=None, repr=False)  # the display's own record of it
    reported: bool = False  # a display printed a progress line of it
    failed: bool = False  # it ended by an exception (the error says why; no "done" line)


class Sink(Protocol):
    """What shows steps (:func:`showing`): told when one starts, advances and ends."""

    def started(self, step: Step) -> None:
        """``step`` began."""

    def advanced(self, step: Step) -> None:
        """``step.completed`` grew."""

    def ended(self, step: Step) -> None:
        """``step`` is over (done or failed)."""


_sink: Sink | None = None
_open: list[Step] = []


@contextmanager
def showing(sink: Sink | None) -> Iterator[None]:
    """Show this process's steps with ``sink`` (None: nothing) while the context lasts."""
    global _sink
    before, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = before


@contextmanager
def step(
    description: str, total: float | None = None, unit: str = "", scale: float = 1.0
) -> Iterator[Callable[..., None]]:
    """A long step named ``description``, of ``total`` ``unit`` (None: unknown); yields
    ``advance(k=1)``, which adds ``k * scale`` units."""
    current = Step(description, total, unit, scale)
    _open.append(current)
    if _sink is not None:
        _sink.started(current)

    try:
        yield lambda k=1: _move(current, k)
    except BaseException:
        current.failed = True
        raise
    finally:
        _open.remove(current)
        if _sink is not None:
            _sink.ended(current)


def advance(k: float = 1) -> None:
    """Advance the innermost open step by ``k`` (times its ``scale``); nothing when none is open."""
    if _open:
        _move(_open[-1], k)


def _move(current: Step, k: float) -> None:
    current.completed += k * current.scale
    if _sink is not None:
        _sink.advanced(current)


def track(items: Iterable[T], description: str, total: int | None = None, unit: str = "") -> Iterator[T]:
    """``items`` one by one, as a step (:func:`step`) that advances by one per item."""
    with step(description, total, unit) as advance:
        for item in items:
            yield item
            advance()


def in_chunks(items: Sequence[T], call: Callable[[Sequence[T]], list[R]], description: str, unit: str) -> list[R]:
    """``call(items)`` made :data:`CHUNK` items at a time as a step: what ``call`` returns per item
    (a tokenizer's batch: the same ids as one call over everything). At most :data:`CHUNK` items
    are one call and no step (a question's few prompts: instant)."""
    if len(items) <= CHUNK:
        return list(call(items))
    out: list[R] = []
    with step(description, len(items), unit) as advance:
        for start in range(0, len(items), CHUNK):
            part = items[start : start + CHUNK]
            out.extend(call(part))
            advance(len(part))
    return out
