"""Transports for plan rounds: torch.distributed P2P, and an in-process mailbox for tests."""

from .base import CommCount, Communicator, Work, comm_counter, record_bytes
from .torch_dist import TorchDistCommunicator

__all__ = ["CommCount", "Communicator", "Work", "comm_counter", "record_bytes", "TorchDistCommunicator"]
