"""``ppq tune script.py``: the user's script runs until it calls ``deepspeed_ppq.initialize``.

While ``capturing`` is on, ``PPQPipelineModule`` leaves its layers as given (the tuner decides the
formats) and ``initialize`` raises ``Captured`` with its arguments, which unwinds the script back to the
tuner (``integrations.autotune``).
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["Captured", "capturing", "is_capturing", "capture_initialize"]

_ON: list[bool] = [False]


class Captured(Exception):
    """The script reached ``deepspeed_ppq.initialize``; ``kwargs`` are its arguments."""

    def __init__(self, kwargs: dict):
        super().__init__("captured deepspeed_ppq.initialize")
        self.kwargs = kwargs


def is_capturing() -> bool:
    return _ON[0]


@contextmanager
def capturing():
    _ON[0] = True
    try:
        yield
    finally:
        _ON[0] = False


def capture_initialize(kwargs: dict) -> None:
    """Called first by ``deepspeed_ppq.initialize``: under ``ppq tune`` it stops the script there."""
    if _ON[0]:
        raise Captured(kwargs)
