"""``data.max_bad_fraction`` exceeded is one line in the ``mmssl`` command, also when a DataLoader
worker found it (torch re-raises it in the training process with the worker's traceback inside)."""

from __future__ import annotations

import pytest
from shard_helpers import count_tokenizer, sample_members, write_tar

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.errors import DataError, one_line


@pytest.mark.parametrize("num_workers", [0, 1])
def test_too_many_bad_samples_are_one_line_naming_the_setting(tmp_path, num_workers):
    members = []
    for i in range(70):
        members += [(f"b{i:03d}.jpg", b"broken"), (f"b{i:03d}.txt", b"x")]
    write_tar(tmp_path / "00000.tar", members + sample_members(0))
    module = ImageTextDataModule(train_data=str(tmp_path), max_bad_fraction=0.1, batch_size=2, num_workers=num_workers,
                                 image_size=8, shuffle_buffer=1, tokenizer=count_tokenizer)
    with pytest.raises(DataError) as raised:
        list(module.train_dataloader())
    line = one_line(raised.value)
    assert line is not None and line.startswith("64 of 64 samples were bad or missing, more than "
                                                "data.max_bad_fraction=0.1; last problems:"), line
    assert "\n" not in line and "Traceback" not in line and "b063" in line
