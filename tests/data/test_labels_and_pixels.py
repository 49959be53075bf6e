"""Bad labels and huge images are bad samples (skipped, counted, shard and key named), in training,
validation and a classifier fine-tune; an image is measured from its header, never decoded."""

from __future__ import annotations

import logging

import pytest
from image_helpers import DecodeSpy, huge_png, jpeg_claiming
from PIL import Image
from shard_helpers import count_tokenizer, sample_members, write_tar

from mmssl.data.datamodule import ImageTextDataModule
from mmssl.data.decode import DEFAULT_MAX_IMAGE_PIXELS, BadSample, open_image, parse_label

OVERFLOW = "99999999999999999999999"


def _module(**kwargs) -> ImageTextDataModule:
    defaults = dict(batch_size=2, num_workers=0, image_size=8, shuffle_buffer=1, tokenizer=count_tokenizer)
    return ImageTextDataModule(**{**defaults, **kwargs})


@pytest.mark.parametrize("raw,expected", [(b"0", 0), (b" 7\n", 7), ("12", 12), (str(2**63 - 1).encode(), 2**63 - 1)])
def test_parse_label_reads_non_negative_int64(raw, expected):
    assert parse_label(raw) == expected


@pytest.mark.parametrize("raw,num_classes,message", [
    (OVERFLOW.encode(), None, f"label overflows int64: {OVERFLOW}"),
    (str(2**63).encode(), None, "overflows int64"),
    (b"-1", None, "label is negative: -1"),
    (b"3", 3, "label 3 is out of range for num_classes=3"),
    (b"x1", None, "label is not an integer: b'x1'"),
    (b"", None, "not an integer"),
    (b"1.5", None, "not an integer"),
    (b"1_0", None, "not an integer"),  # Python's int() would read 10
    ("\u0661".encode(), None, "not an integer"),  # an Arabic-Indic digit, which int() reads as 1
])
def test_parse_label_refuses_what_is_not_a_class(raw, num_classes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_label(raw, num_classes)


def _labelled_shard(path, labels: list[str]) -> None:
    members = []
    for i, label in enumerate(labels):
        good = sample_members(i)
        members += [m for m in good if not m[0].endswith(".cls")] + [(f"s{i:05d}.cls", label.encode())]
    write_tar(path, members)


def test_bad_labels_are_skipped_counted_and_named_in_training_and_validation(tmp_path, caplog):
    # Before: the overflowing label crashed batch stacking ("Overflow when unpacking long long"),
    # naming no shard; -1 and a label beyond the classes reached the model.
    labels = ["0", OVERFLOW, "1", "-1", "2", "3", "1", "0"]  # 3 is beyond num_classes=3
    _labelled_shard(tmp_path / "00000.tar", labels)
    url = str(tmp_path / "00000.tar")
    module = _module(val_data=url, num_classes=3)
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        batches = list(module.val_dataloader())
    assert [x for b in batches for x in b["label"].tolist()] == [0, 1, 2, 1, 0]
    assert sum(int(b["__skipped__"]) for b in batches) == 3
    lines = [r.getMessage() for r in caplog.records]
    for key, reason in (("s00001", "overflows int64"), ("s00003", "is negative"),
                        ("s00005", "'cls' 3 is out of range for num_classes=3")):
        assert any(f"'{key}'" in line and "00000.tar" in line and reason in line for line in lines), key
    # Training: the same samples are skipped and counted where data/skipped is logged.
    module = _module(train_data=url, num_classes=3, max_bad_fraction=1.0)
    for batch in module.train_dataloader():
        assert batch["label"].max() < 3
        module.on_before_batch_transfer(batch, 0)
    assert module.position.skipped >= 3  # a second pass that fills the epoch meets them again
    with pytest.raises(ValueError, match="data.init_args.num_classes must be >= 1"):
        _module(num_classes=0)


def test_huge_images_are_bad_samples_measured_from_the_header_never_decoded(tmp_path, caplog, monkeypatch, recwarn):
    # Before: a 13000x13000 PNG decoded (169 Mpx, +500 MB as RGB) and a JPEG whose header claims
    # 12000x12000 was allocated before its missing data was found.
    png, jpeg = huge_png(13000), jpeg_claiming(12000, 12000)
    assert len(png) < 64_000 and len(jpeg) < 2_000  # cheap on disk
    members = sample_members(0) + [("big.png", png), ("big.txt", b"a caption"), ("claims.jpg", jpeg),
                                   ("claims.txt", b"a caption")] + sample_members(1)
    write_tar(tmp_path / "00000.tar", members)
    spy = DecodeSpy(monkeypatch)
    module = _module(val_data=str(tmp_path / "00000.tar"))
    assert module.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS == 89_478_485  # PIL's bomb warning threshold
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        batches = list(module.val_dataloader())
    assert sum(b["image"].shape[0] for b in batches) == 2 and sum(int(b["__skipped__"]) for b in batches) == 2
    assert spy.sizes and spy.largest() <= 64  # only the 8x8 good images were decoded
    assert not [w for w in recwarn if issubclass(w.category, Image.DecompressionBombWarning)]  # our line instead
    lines = [r.getMessage() for r in caplog.records]
    for key, size in (("big", "13000x13000"), ("claims", "12000x12000")):
        assert any(f"'{key}'" in line and "00000.tar" in line and size in line and "max_image_pixels=89478485" in line
                   for line in lines), key
    # The limit is the key's value; with a smaller one, ordinary images become bad as well.
    with pytest.raises(BadSample, match=r"8x8 image \(64 pixels\) is above max_image_pixels=63"):
        open_image(sample_members(0)[0][1], max_pixels=63)
    with pytest.raises(ValueError, match="data.init_args.max_image_pixels must be >= 1"):
        _module(max_image_pixels=0)
    assert _module(max_image_pixels=None)._decoder(train=False).max_pixels is None  # null: no limit of mmssl's


def test_a_classifier_fine_tune_skips_labels_beyond_its_classes_naming_them(tmp_path, caplog):
    """``mmssl fit`` links the classifier's ``num_classes`` to the data: a label beyond it is a bad
    sample named with its shard and key. Before: the loss's one-hot raised mid-run, naming neither."""
    from mmssl.cli import cli_main
    from tests.cli_runs import REPO

    for s in range(2):
        write_tar(tmp_path / f"{s:05d}.tar",
                  [m for i in range(8 * s, 8 * s + 8) for m in sample_members(i, label=4 if i == 9 else i % 4)])
    with caplog.at_level(logging.WARNING, logger="mmssl.data"):
        cli = cli_main(
            [
                "fit",
                "--config",
                str(REPO / "configs/finetune/demo.yaml"),
                "--model.init_args.num_classes=4",
                "--model.init_args.image_size=16",
                '--model.init_args.model_kwargs={"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}',
                f"--data.init_args.train_data={tmp_path}",
                f"--data.init_args.val_data={tmp_path}/00001.tar",
                "--data.init_args.batch_size=4",
                "--data.init_args.num_workers=0",
                "--data.init_args.max_bad_fraction=0.5",
                "--trainer.max_steps=3",
                "--trainer.limit_val_batches=1",
                "--trainer.num_sanity_val_steps=0",
                "--trainer.callbacks=[]",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={tmp_path / 'runs'}",
            ]
        )
    assert cli.datamodule.num_classes == cli.model.num_classes == 4 and cli.trainer.global_step == 3
    assert any("'s00009'" in r.getMessage() and "00001.tar" in r.getMessage()
               and "'cls' 4 is out of range for num_classes=4" in r.getMessage() for r in caplog.records)
