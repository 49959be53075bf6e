"""Checkpoint files. Below the models: the one safe reader (:mod:`.read`), the key layouts and the
one table of model kinds (:mod:`.layouts`, no model import), a file's form, kind, init arguments and
weights (:mod:`.model_file`, which the models' own loaders use). Above them: the LightningModule
built from a file (:mod:`.load`), the FSDP2 strategy (:mod:`.sharded`, its background saves
:mod:`.async_save`), run folders (:mod:`.resume`).

``from mmssl.checkpoints import read_checkpoint`` stays the public spelling. Nothing above the
models is imported here: models import this package's lower floor.
"""

from mmssl.checkpoints.read import SAFE_GLOBALS, UnsafeCheckpointError, read_checkpoint, read_state_dict

__all__ = ["SAFE_GLOBALS", "UnsafeCheckpointError", "read_checkpoint", "read_state_dict"]
