"""The refusal of a non-zip checkpoint names exactly the globals it pickles, whatever the pickle
protocol (GLOBAL opcodes up to protocol 2, STACK_GLOBAL from 4) or torch's legacy file layout."""

from __future__ import annotations

import pickle

import pytest
import torch

from mmssl.checkpoints import UnsafeCheckpointError, read_checkpoint
from tests.checkpoints.test_checkpoints import OpenPayload

OPEN = f"{open.__module__}.open"  # io.open: what the payload's __reduce__ pickles


def _refusal(path) -> str:
    with pytest.raises(UnsafeCheckpointError) as error:
        read_checkpoint(str(path))
    return str(error.value)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_a_bare_pickle_is_refused_naming_its_global(tmp_path, protocol):
    marker, path = tmp_path / "pwned", tmp_path / "evil.pth"
    with open(path, "wb") as f:
        pickle.dump({"state_dict": {"w": [0.0, 1.0]}, "x": OpenPayload(marker)}, f, protocol=protocol)
    assert f"the file pickles {OPEN}, which mmssl does not allow" in _refusal(path)
    assert not marker.exists()


def test_torchs_legacy_layout_is_refused_naming_its_global(tmp_path):
    # torch.save's pre-zip layout: magic number, protocol, system info, then the object (GLOBALs).
    marker, path = tmp_path / "pwned", tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "x": OpenPayload(marker)}, path,
               _use_new_zipfile_serialization=False)
    assert f"the file pickles {OPEN}, which mmssl does not allow" in _refusal(path)
    assert not marker.exists()


def test_a_pickle_of_a_global_alone_is_named(tmp_path):
    path = tmp_path / "evil.pth"
    path.write_bytes(pickle.dumps(open, protocol=4))  # the module and name are its only strings
    assert f"the file pickles {OPEN}, which" in _refusal(path)
