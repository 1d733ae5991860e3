"""Exceptions raised by the collective layer, shared by every frontend."""


class HvdrayError(RuntimeError):
    """Base class of hvdray's collective errors."""


class NotInitializedError(HvdrayError, ValueError):
    """An op was called before ``hvd.init()`` (or after ``hvd.shutdown()``)."""

    def __init__(self, what: str = "this operation") -> None:
        super().__init__(f"hvdray has not been initialized; call hvd.init() before {what}")


class TensorMismatchError(HvdrayError, ValueError):
    """Ranks submitted the same tensor name with different shapes, dtypes, ops or arguments."""


class UnsupportedReductionError(HvdrayError, ValueError):
    """A reduce op the collective does not offer (reducescatter with Adasum or Product, or of bools): a
    ``RuntimeError`` as Horovod raises it, and a ``ValueError`` as for any other bad argument."""


class NetworkDeviceError(HvdrayError, ValueError):
    """This rank cannot open the network device its Gloo groups would use: the interface that ``nics``
    names is not on its node, or the node's address cannot be bound. A fault of the worker's settings or
    machine, not of a peer, so it is never taken for a broken ring: an elastic job ends with it instead
    of waiting for another membership epoch that would fail the same way."""


class HorovodInternalError(HvdrayError):
    """The ring broke: a peer died, timed out or shut down. Elastic training catches this to reset."""


def caused_by_peer(exc: BaseException) -> bool:
    """True for an error that another rank's failure caused on this one: an op a leaving peer never
    submitted, a ring a dead peer broke, or a wrapper marked ``caused_by_peer`` (hvdrayrun's script failure)."""
    return isinstance(exc, (PeerFinishedError, HorovodInternalError)) or bool(getattr(exc, "caused_by_peer", False))


class PeerFinishedError(HvdrayError):
    """An op can never complete: a rank it waits for has left the function it ran in (returned from it or
    raised) without submitting the op. A program error (ranks disagree on the collectives they call), not a
    broken ring: elastic training does not reset on it."""
