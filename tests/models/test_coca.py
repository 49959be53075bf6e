"""CoCa (mmssl.models.coca) over open_clip's CoCa and CoCaLoss: the loss is open_clip's, exact on 2
gloo ranks against one process on the concatenated batch (captions of different lengths on each
rank), GradCache chunks give the whole batch's loss and gradients with FLIP on, generation,
export to open_clip, and a tokenizer that cannot be built stopping the run before training."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import open_clip
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from open_clip.loss import CoCaLoss
from torch.nn.parallel import DistributedDataParallel

from mmssl.checkpoints.load import load_lightning
from mmssl.evaluation.captions import decode_captions, generate_captions, names_class
from mmssl.export import export_checkpoint
from mmssl.models import generation
from mmssl.models.coca import CoCa

WORLD = 2
REPO = Path(__file__).resolve().parents[2]
REPO_CLIP = REPO / "configs" / "models" / "clip_micro.json"
# Rank 0 gets the short captions, rank 1 the long ones: 4 + 4 samples, 16 vs 36 label tokens, so
# a plain mean over ranks of the per-rank token means would differ from the global token mean.
CAPTIONS = ["red", "a star", "blue", "a cross",
            "a large red circle in the top left on white", "a small blue square in the center on black",
            "a drawing of a star in the bottom right", "a picture of a green cross, small, on gray"]


def _model(json_path: str, **kwargs) -> CoCa:
    torch.manual_seed(0)  # identical initial weights in every process
    return CoCa(json_path, warmup_steps=0, **kwargs).train()


def _batch(model: CoCa) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(CAPTIONS), 3, 32, 32, generator=g), model.tokenizer(CAPTIONS)


def _step(model: CoCa, images: torch.Tensor, tokens: torch.Tensor) -> tuple[float, float, dict]:
    contrastive, caption = model.losses(images, tokens)
    (contrastive + caption).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return contrastive.item(), caption.item(), grads


def test_the_loss_is_open_clips_coca_loss_with_the_papers_weights(tiny_coca_json):
    model = _model(tiny_coca_json)
    images, tokens = _batch(model)
    out = model(images, tokens)
    theirs = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=1.0)(
        out["image_features"], out["text_features"], out["logits"], out["labels"], out["logit_scale"])
    torch.manual_seed(0)
    mine = model.losses(images, tokens)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b)
    assert isinstance(model.model, open_clip.CoCa) and model.hparams.caption_loss_weight == 2.0
    rebuilt = CoCa(**model.hparams)  # a checkpoint's hyper-parameters rebuild a CoCa, CLIP's parts included
    assert isinstance(rebuilt, CoCa) and rebuilt.hparams == model.hparams


def test_a_fresh_model_is_initialised_from_the_seed_alone(tiny_coca_json):
    """open_clip leaves the decoder's text_projection as torch.empty memory; CoCa initialises it."""
    torch.empty(16, 49408).fill_(3.0e12)  # freed memory a later torch.empty may hand out again
    first, second = _model(tiny_coca_json).state_dict(), _model(tiny_coca_json).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    std = first["model.text_decoder.text_projection"].std().item()
    assert std == pytest.approx(16 ** -0.5, rel=0.05)  # open_clip's init_parameters: width ** -0.5


def test_gradcache_chunks_give_the_whole_batch_loss_and_gradients_with_flip(tiny_coca_json):
    results = []
    for chunk in (None, 3):
        model = _model(tiny_coca_json, flip={"mask_ratio": 0.5}, contrastive_chunk_size=chunk)
        torch.manual_seed(7)  # the same FLIP masks: the chunks draw them in batch order
        results.append(_step(model, *_batch(model)))
    (c1, k1, g1), (c2, k2, g2) = results
    assert c2 == pytest.approx(c1, rel=1e-5) and k2 == pytest.approx(k1, rel=1e-5)
    assert g1.keys() == g2.keys() and any("text_decoder" in n for n in g1)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_flip_masks_the_image_tokens_in_training_only(tiny_coca_json):
    model = _model(tiny_coca_json, flip={"mask_ratio": 0.75})
    images = torch.randn(2, 3, 32, 32)
    seen = []
    hook = model.model.visual.attn_pool.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    model.model(images)
    model.eval()
    model.model(images)
    hook.remove()
    assert seen == [1 + 4, 1 + 16]  # cls + 25% of the 4 x 4 patches in training; all of them in eval


class _Losses(torch.nn.Module):
    def __init__(self, model: CoCa) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.model.losses(images, tokens))  # (2,): contrastive, caption


def _worker(local_rank: int, init_file: str, json_path: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=local_rank, world_size=WORLD)
    model = _model(json_path)
    images, tokens = _batch(model)
    rows = slice(local_rank * 4, local_rank * 4 + 4)
    ddp = DistributedDataParallel(_Losses(model))  # averages gradients over ranks, as Lightning's DDP
    losses = ddp(images[rows], tokens[rows])  # inside DDP's forward, as Lightning runs training_step
    losses.sum().backward()
    losses = losses.detach()
    dist.all_reduce(losses)
    torch.save({"losses": (losses / WORLD).tolist(),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}},
               f"{out_file}.{local_rank}")
    dist.destroy_process_group()


def test_two_ranks_equal_one_process_on_the_concatenated_batch(tmp_path, tiny_coca_json):
    out_file = str(tmp_path / "results")
    mp.start_processes(_worker, args=(str(tmp_path / "init"), tiny_coca_json, out_file), nprocs=WORLD,
                       start_method="fork")
    model = _model(tiny_coca_json)
    contrastive, caption, grads = _step(model, *_batch(model))
    for r in range(WORLD):
        got = torch.load(f"{out_file}.{r}", weights_only=True)
        assert got["losses"] == pytest.approx([contrastive, caption], rel=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_beam_search_of_one_beam_is_greedy_decoding(tiny_coca_json):
    model = _model(tiny_coca_json).eval()
    images = torch.randn(3, 3, 32, 32)
    ids = model.generation_ids()
    beam = generation.beam_search(model.model, images, num_beams=1, seq_len=8, min_seq_len=3, **ids)
    greedy = model.generate(images, generation_type="top_k", top_k=1, seq_len=8, min_seq_len=3)
    assert decode_captions(model.tokenizer, beam, **ids) == decode_captions(model.tokenizer, greedy, **ids)
    assert beam.shape[1] <= 8 and (beam[:, 0] == ids["sot_token_id"]).all()
    wide = generate_captions(model, images, "beam_search", seq_len=8, num_beams=4)
    assert len(wide) == 3 and all(isinstance(c, str) for c in wide)
    with pytest.raises(ValueError, match="seq_len must be in"):
        model.generate(images, seq_len=40)
    # No seq_len: the model's own text context (a fixed 20 was refused by this 16-token context).
    assert model.generate(images, generation_type="top_k", top_k=1).shape[1] <= model.model.context_length


def test_names_class_matches_the_class_name_as_a_phrase():
    assert names_class("a small red circle in the top left", "red circle")
    assert names_class("A picture of a Red, circle", "red circle")
    assert not names_class("a red square next to a circle", "red circle")
    assert not names_class("a reddish circle", "red circle")


def test_checkpoint_loads_as_coca_and_exports_to_open_clip_strictly(tmp_path, tiny_coca_json):
    model = _model(tiny_coca_json).eval()
    ckpt = tmp_path / "coca.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, ckpt)  # no class recorded
    loaded = load_lightning(str(ckpt))
    assert type(loaded) is CoCa
    export_checkpoint(str(ckpt), "open_clip", str(tmp_path / "coca.safetensors"))
    open_clip.add_model_config(tiny_coca_json)
    theirs, _, _ = open_clip.create_model_and_transforms(
        "coca_test_tiny", pretrained=str(tmp_path / "coca.safetensors")
    )
    images, tokens = _batch(model)
    with torch.no_grad():
        torch.testing.assert_close(theirs.eval()(images, tokens)["logits"], model(images, tokens)["logits"])


def test_a_tokenizer_that_cannot_be_built_stops_the_run_before_training(tmp_path, tiny_coca_json):
    from mmssl.cli import main

    config = json.loads(open(tiny_coca_json).read())
    config["text_cfg"]["hf_tokenizer_name"] = "org/coca-tokenizer"
    path = tmp_path / "coca_hf_tok.json"
    path.write_text(json.dumps(config))
    fetch = "huggingface-cli download org/coca-tokenizer --local-dir DIR"
    with pytest.raises(FileNotFoundError, match=fetch):
        CoCa(str(path))
    # The CLI lists the constructor's error (jsonargparse wraps it in a ValueError) and stops.
    with pytest.raises((FileNotFoundError, ValueError), match=fetch):
        main(["fit", "--model=mmssl.models.coca.CoCa", f"--model.model_name={path}",
              "--data=mmssl.data.datamodule.ImageTextDataModule", f"--trainer.default_root_dir={tmp_path}"])
    assert not (tmp_path / "version_0" / "checkpoints").exists()
    with pytest.raises(ValueError, match="no CoCa config.*mmssl.models.clip.CLIP"):
        CoCa(str(REPO_CLIP))


class StopAtStep(pl.Callback):
    """End the fit cleanly once ``global_step`` reaches ``step`` (its checkpoint written), as a preempted run."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_a_stopped_run_resumes_to_the_uninterrupted_weights(tmp_path, tiny_demo, tiny_coca_json):
    """FLIP masks (the torch RNG), the shard stream and a validation before the stop all cross the resume."""
    import yaml

    from mmssl.cli import main

    def args(root, *callbacks):
        overrides = {
            "trainer": {"max_steps": 5, "val_check_interval": 2, "enable_progress_bar": False,
                        "default_root_dir": str(root), "callbacks": [
                            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                             "init_args": {"every_n_train_steps": 1, "save_last": True, "save_top_k": 0}},
                            {"class_path": "tests.helpers.DumpParams", "init_args": {"folder": str(root / "params")}},
                            *callbacks]},
            "model": {"init_args": {"model_name": tiny_coca_json, "flip": {"mask_ratio": 0.5}, "warmup_steps": 2}},
            "data": {"init_args": {"demo_dir": tiny_demo.root, "batch_size": 8, "num_workers": 0}},
        }
        path = tmp_path / f"{root.name}{len(callbacks)}.yaml"
        path.write_text(yaml.safe_dump(overrides))
        return ["fit", "--config", str(REPO / "configs/demo/coca.yaml"), "--config", str(path)]

    main(args(tmp_path / "reference"))
    main(args(tmp_path / "resumed", {"class_path": "tests.models.test_coca.StopAtStep", "init_args": {"step": 3}}))
    main([*args(tmp_path / "resumed"), "--ckpt_path=last"])
    want = torch.load(tmp_path / "reference" / "params" / "rank0.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed" / "params" / "rank0.pt", weights_only=True)
    assert got.keys() == want.keys()
    assert not [k for k in want if not torch.equal(got[k], want[k])]


def test_caption_naming_counts_every_labelled_image(tiny_demo, tiny_coca_json):
    from mmssl.data.labeled import labeled_loader
    from mmssl.data.transforms import eval_transform
    from mmssl.evaluation.captions import caption_naming_evaluate

    model = _model(tiny_coca_json)
    batches = labeled_loader(tiny_demo.eval_dir, eval_transform(32, model.image_mean, model.image_std), 16, limit=20)
    out = caption_naming_evaluate(model, batches, tiny_demo.classnames, torch.device("cpu"),
                                  generation_type="top_k", top_k=1, seq_len=6)
    assert out["num_samples"] == 20 and 0.0 <= float(out["names_class"]) <= 1.0
    assert model.training  # left as it was
