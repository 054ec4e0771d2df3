"""The error by which the fast trace steps aside (:mod:`ir.block_capture.trace`).

Every check of the fast path raises :class:`Unsupported` with the reason;
:func:`ir.block_capture.trace.fast_trace` logs it and the full capture is used.
"""


class Unsupported(Exception):
    """The fast path cannot vouch for this model; the full capture is used."""
