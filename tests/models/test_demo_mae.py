"""configs/demo/mae.yaml end to end through the CLI, then its checkpoint exported to timm."""

from pathlib import Path

import timm
import torch

from mmssl.cli import main
from mmssl.export import export_checkpoint
from mmssl.models.mae import MAE

ROOT = Path(__file__).resolve().parents[2]


def test_demo_mae_fit_and_export(tmp_path, tiny_demo):
    main([
        "fit", "--config", str(ROOT / "configs/demo/mae.yaml"),
        f"--data.demo_dir={tiny_demo.root}", "--data.num_workers=0", "--data.batch_size=8",
        "--trainer.max_steps=3", "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ])
    run = tmp_path / "version_0"
    assert (run / "config.yaml").is_file() and list(run.glob("events.out.tfevents.*"))
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    assert list((run / "reconstructions").glob("step_*.png")), "Reconstructions callback wrote no grid"

    state = export_checkpoint(str(ckpt), "timm", str(tmp_path / "vit.pth"))
    vit = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=0, global_pool="token",
        img_size=32, patch_size=4, embed_dim=128, depth=4, num_heads=4,
    ).eval()
    result = vit.load_state_dict(torch.load(tmp_path / "vit.pth", weights_only=True))
    assert not result.missing_keys and not result.unexpected_keys and len(state) == len(vit.state_dict())
    model = MAE.load_from_checkpoint(str(ckpt)).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit(images), model.encode_image(images), rtol=0, atol=1e-5)
