"""Checkpoint files: the one safe reader (:mod:`.read`), the key layouts and the one table of
model kinds (:mod:`.layouts`, no model import), and modules built from files (:mod:`.load`).

``from mmssl.checkpoints import read_checkpoint`` stays the public spelling. :mod:`.load` is not
imported here: it builds models, and models import this package's lower floor.
"""

from mmssl.checkpoints.read import SAFE_GLOBALS, UnsafeCheckpointError, read_checkpoint, read_state_dict

__all__ = ["SAFE_GLOBALS", "UnsafeCheckpointError", "read_checkpoint", "read_state_dict"]
