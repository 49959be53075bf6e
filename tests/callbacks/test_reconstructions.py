import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from PIL import Image

from mmssl.callbacks.reconstructions import Reconstructions
from mmssl.models.mae import MAE
from tests.models.test_mae import TINY, ImageData


def test_writes_grids_to_run_folder_and_tensorboard(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="run")
    trainer = L.Trainer(
        max_steps=4, logger=logger, callbacks=[Reconstructions(every_n_steps=2, num_images=3, zoom=2)],
        enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=1,
    )
    trainer.fit(MAE(**TINY), datamodule=ImageData())
    folder = tmp_path / "run" / "version_0" / "reconstructions"
    pngs = sorted(p.name for p in folder.glob("*.png"))
    assert pngs == ["step_000002.png", "step_000004.png"]
    width, height = Image.open(folder / pngs[0]).size
    assert (width, height) == (4 * 66 + 2, 3 * 66 + 2)  # 4 panels x 3 images of 2 x 32 px, padding 2
    assert list((tmp_path / "run" / "version_0").glob("events.out.tfevents.*"))
