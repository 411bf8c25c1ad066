"""Communicator backends behind one contract (see base.py). Backends are
imported by name when first used, so the NCCL one never loads CUDA unless
asked for."""

from .base import CommConfig, CommState, Communicator, Event, Stream

__all__ = ["CommConfig", "CommState", "Communicator", "Event", "Stream"]
