"""Refusals the gateway makes itself, before any hop.

Every status error derives from hopline.runtime.errors.StatusError, whose docstring draws the
whole hierarchy; this module holds only the gateway's own request checks' error.
"""

from __future__ import annotations

from hopline.runtime.errors import StatusError


class RequestError(StatusError):
    """A request the gateway refuses before any hop: bad text, unknown model, bad top_k."""
