"""What every section shares: the one-line error, a section's model config, the device and run-name patterns."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from fedtune.errors import FedtuneError


class ConfigError(FedtuneError, ValueError):
    """An invalid configuration key or value; the message is one line naming it."""


class Section(BaseModel):
    """A recipe table: unknown keys refused, every number finite; a plain string is its ``name``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # every number finite

    @model_validator(mode="before")
    @classmethod
    def _string_is_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


#: ``device`` (and each ``placement.client_devices`` entry but ``auto``).
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]{1,2})?|mps")
#: A run folder's name: one path component (no separator, no "." or ".."), of characters that need no
#: quoting in a shell; a default name made from a data set's file name is mapped onto it.
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")
