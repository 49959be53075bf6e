"""Checkpoints -> timm / open_clip / transformers files and folders.

* :mod:`.checkpoint`: :func:`export_checkpoint`, the formats and the state-dict files.
* :mod:`.paths`: where an export may write (refusals, ``--overwrite``, temporary-then-replace).
* :mod:`.hub`: open_clip and timm hub folders. :mod:`.hf`: transformers ``CLIPModel`` folders.
"""

from mmssl.export.checkpoint import (
    EXPORTERS,
    FILE_SUFFIXES,
    FOLDER_EXPORTERS,
    FORMATS,
    check_format,
    export_checkpoint,
    to_open_clip,
    to_timm,
)
from mmssl.export.paths import EXPORT_FILE_NAMES, check_output

__all__ = ["EXPORTERS", "EXPORT_FILE_NAMES", "FILE_SUFFIXES", "FOLDER_EXPORTERS", "FORMATS", "check_format",
           "check_output", "export_checkpoint", "to_open_clip", "to_timm"]
