"""A checkpoint file the reader refuses is named with the reason, even where no global name
explains it: a legacy pickle that torch's weights-only unpickler rejects for an opcode
(``EXT1``, the extension registry) rather than a global, and ``--ema`` asked through
``read_state_dict`` of a checkpoint without an average.
"""

from __future__ import annotations

import io
import pickle
import sys

import pytest
import torch
from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

from mmssl.checkpoints.read import UnsafeCheckpointError, read_checkpoint, read_state_dict


def _legacy_file_with_an_extension_code(path) -> None:
    """torch's legacy (non-zip) layout: magic, protocol, system info, then an object pickled as
    ``EXT1 1`` (no GLOBAL opcode at all), then the storage keys."""
    out = io.BytesIO()
    info = {"protocol_version": PROTOCOL_VERSION, "little_endian": sys.byteorder == "little",
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    for header in (MAGIC_NUMBER, PROTOCOL_VERSION, info):
        pickle.dump(header, out, protocol=2)
    out.write(b"\x80\x02\x82\x01.")
    pickle.dump([], out, protocol=2)
    path.write_bytes(out.getvalue())


def test_a_file_refused_without_an_offending_global_says_the_unpickler_refused_its_content(tmp_path):
    path = tmp_path / "old.pt"
    _legacy_file_with_an_extension_code(path)
    with pytest.raises(UnsafeCheckpointError) as err:
        read_checkpoint(str(path))
    assert str(err.value).startswith(
        f"{path}: refused to load: the file pickles content torch's weights-only unpickler does not accept, "
        "which mmssl does not allow")


def test_the_ema_refusal_through_read_state_dict_names_the_file(tmp_path):
    path = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}}, path)
    with pytest.raises(ValueError) as err:
        read_state_dict(str(path), ema=True)
    assert str(err.value).startswith(f"{path}: --ema asks for averaged weights and this checkpoint holds none")
