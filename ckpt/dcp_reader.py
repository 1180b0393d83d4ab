"""The documented import path ``ckpt.dcp_reader.CheckpointReader``: our checkpoints read in
place by ``torch.distributed.checkpoint.load`` (the code is in ``ckpt.interop.dcp_reader``)."""
from .interop.dcp_reader import CheckpointReader

__all__ = ["CheckpointReader"]
