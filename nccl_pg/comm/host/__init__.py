"""The host backend: the Communicator contract for numpy arrays over TCP."""

from .communicator import HostCommunicator
from .stream import HostEvent, HostStream

__all__ = ["HostCommunicator", "HostEvent", "HostStream"]
