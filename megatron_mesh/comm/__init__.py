"""Transports for plan rounds: torch.distributed P2P, an in-process mailbox (all ranks of a plan
in one process, for tests and single-device benchmarks), and one rank replayed alone from a
recording of its received messages (single-device benchmarks)."""

from .alltoall import AllToAllCommunicator
from .base import CommCount, Communicator, Work, comm_counter, record_bytes
from .inprocess import InProcessCommunicator, InProcessError, Mailbox, run_inprocess
from .replay import Recorder, ReplayCommunicator
from .torch_dist import TorchDistCommunicator

__all__ = ["AllToAllCommunicator", "CommCount", "Communicator", "Work", "comm_counter", "record_bytes", "TorchDistCommunicator",
           "InProcessCommunicator", "InProcessError", "Mailbox", "run_inprocess", "Recorder", "ReplayCommunicator"]
