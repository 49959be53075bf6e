"""Checkpoint files: the one safe reader (:mod:`.read`).

``from mmssl.checkpoints import read_checkpoint`` stays the public spelling; the modules below
are the floor that loading, writing and exporting build on.
"""

from mmssl.checkpoints.read import SAFE_GLOBALS, UnsafeCheckpointError, read_checkpoint, read_state_dict

__all__ = ["SAFE_GLOBALS", "UnsafeCheckpointError", "read_checkpoint", "read_state_dict"]
