"""CLIPMLM (CLIP + MLM + ITM): gradients, loss terms by hand, refusals, and 2 DDP processes
through the real CLI logging the validation figures of one."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mmssl.losses import clip_loss
from mmssl.models.clip_mlm import CLIPMLM
from mmssl.models.token_masking import IGNORE_INDEX
from mmssl.objectives import itm_sums, pick_negatives, sample_uniforms
from tests.cli_runs import PG_TIMEOUT, REPO, last_metrics, run_mmssl, run_one_process

MICRO = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49409, "width": 32, "heads": 2, "layers": 1,
                 "no_causal_mask": True},
}
CAPTIONS = ["a small red square top left", "a big blue circle", "a small red square top left", "green triangle"]


def _json(folder, **text_cfg) -> str:
    config = json.loads(json.dumps(MICRO))
    config["text_cfg"].update(text_cfg)
    config["text_cfg"] = {k: v for k, v in config["text_cfg"].items() if v is not None}
    path = folder / f"clip_mlm_{len(list(folder.glob('*.json')))}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def micro_json(tmp_path_factory) -> str:
    return _json(tmp_path_factory.mktemp("models"))


def _model(micro_json: str, **kwargs) -> CLIPMLM:
    torch.manual_seed(0)
    return CLIPMLM(model_name=micro_json, warmup_steps=0, **kwargs)


def test_every_parameter_gets_a_gradient(micro_json):
    for loss in ("clip", "siglip"):
        model = _model(micro_json, loss=loss).train()
        terms = model.losses(torch.randn(4, 3, 32, 32), model.tokenizer(CAPTIONS))  # contrastive, mlm, itm
        assert len(terms) == 3 and all(torch.isfinite(t) for t in terms), terms
        sum(terms).backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, (loss, missing)


def test_text_tower_reads_both_sides(micro_json):
    """A later word changes an earlier token's state: the tower has no causal mask."""
    model = _model(micro_json).eval()
    tokens = model.tokenizer(["a red square", "a red circle"])
    with torch.no_grad():
        states = model.forward_text_tokens(tokens)  # (2, L, W)
    assert not torch.allclose(states[0, 2], states[1, 2])  # "red", followed by different words


def test_loss_terms_by_hand(micro_json):
    model = _model(micro_json, mlm_weight=0.7, itm_weight=0.3).eval()
    images, tokens = torch.randn(4, 3, 32, 32), model.tokenizer(CAPTIONS)
    noise = torch.rand(*tokens.shape, 3, generator=torch.Generator().manual_seed(0))
    mlm = model.objectives["mlm"]
    with torch.no_grad():
        out = model(images, tokens)
        masking = model.mask_captions(tokens, noise)
        batch = {"mlm_labels": masking.labels, "mlm_selected": masking.selected}
        ce_sum, correct, count = mlm.sums(model.forward_text_tokens(masking.input_ids), batch)
        itm_sum, hits, itm_count = itm_sums(model.itm_head, out, tokens, None, gathered=False)
        # MLM by hand: open_clip's text transformer without a mask, BERT's head tied to the embeddings.
        m = model.model
        x = m.token_embedding(masking.input_ids) + m.positional_embedding
        states = m.ln_final(m.transformer(x, attn_mask=None))  # (B, L, W)
        head = model.mlm_head
        logits = F.layer_norm(F.gelu(states @ head.dense.weight.T + head.dense.bias), (states.shape[-1],),
                              head.norm.weight, head.norm.bias) @ m.token_embedding.weight.T + head.bias
        chosen = masking.labels != IGNORE_INDEX
        expected = F.cross_entropy(logits[chosen], masking.labels[chosen], reduction="sum")
        assert count == chosen.sum() == 4  # one of each caption's 1-6 words (BERT: max(1, round(0.15 n)))
        assert ce_sum == pytest.approx(float(expected), rel=1e-4)
        assert correct == (logits[chosen].argmax(-1) == masking.labels[chosen]).sum()
        # ITM by hand: captions 0 and 2 are the same text, so neither is the other's negative.
        image, text = out["image_features"], out["text_features"]
        sim = image @ text.T
        rows, terms = [], []
        for i in range(4):
            others = [j for j in range(4) if tokens[j].tolist() != tokens[i].tolist()]
            neg_image = max(others, key=lambda j: float(sim[j, i]))  # the image most like caption i
            neg_text = max(others, key=lambda j: float(sim[i, j]))  # the caption most like image i
            if i in (0, 2):
                assert 2 - i not in others
            rows += [(i, i, 1), (i, neg_image, 0), (neg_text, i, 0)]
        for t, v, label in rows:
            logit = model.itm_head(text[t:t + 1], out["image_tokens"][v:v + 1])
            terms.append(F.cross_entropy(logit, torch.tensor([label]), reduction="sum"))
        assert itm_count == 12 and itm_sum == pytest.approx(float(sum(terms)), rel=1e-4)
        # The terms, as training weighs them (one process: the token mean), on training's draws: the
        # masking noise is the first 3L of each sample's uniforms (the negatives' 2N follow).
        model.train()
        torch.manual_seed(1)
        contrastive_term, mlm_term, itm_term = model.losses(images, tokens)
        again = model(images, tokens)  # FLIP is off: training mode sees whole images too
        contrastive = clip_loss(again["image_features"], again["text_features"], m.logit_scale.exp())
        assert contrastive_term == pytest.approx(float(contrastive), rel=1e-5)
        length = tokens.shape[1]
        drawn = model.mask_captions(tokens, model.uniforms(images, 3 * length + 8, True)[:, :3 * length].reshape(
            4, length, 3))
        ce_sum, _, count = mlm.sums(model.forward_text_tokens(drawn.input_ids),
                                    {"mlm_labels": drawn.labels, "mlm_selected": drawn.selected})
        assert mlm_term == pytest.approx(0.7 * float(ce_sum / count), rel=1e-5)
        assert 0 < itm_term < 0.3 * 3  # 0.3 x the CE mean of 12 pairs of 2 classes, near log 2


def test_caption_without_maskable_token_contributes_nothing(micro_json):
    model = _model(micro_json).train()
    images = torch.randn(2, 3, 32, 32)
    empty = model.tokenizer(["", ""])  # start and end of text only
    terms = model.losses(images, empty)
    assert terms[1] == 0 and torch.isfinite(sum(terms))
    assert model.objectives["mlm"].figures["captions_without_target"] == 2
    sum(terms).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    mixed = model.tokenizer(["", "a blue circle"])
    noise = torch.rand(*mixed.shape, 3, generator=torch.Generator().manual_seed(0))
    assert model.mask_captions(mixed, noise).selected.sum() == 1  # the second caption's one chosen word


def test_negatives_follow_the_softmax_and_skip_invalid_columns():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0]]).expand(20000, 4)
    valid = torch.tensor([[True, True, True, False]]).expand(20000, 4)
    index, found = pick_negatives(logits, valid, torch.rand(20000, 4, generator=torch.Generator().manual_seed(0)))
    share = torch.bincount(index, minlength=4).float() / 20000
    assert found.all() and share[3] == 0
    assert torch.allclose(share[:3], torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0), atol=0.015)
    index, found = pick_negatives(torch.zeros(2, 3), torch.tensor([[False] * 3, [True, False, True]]))
    assert found.tolist() == [False, True] and index[1] in (0, 2)


def test_draws_depend_on_the_global_index_not_the_split():
    whole = sample_uniforms(0, 5, 0, 4, 7, torch.device("cpu"))
    halves = torch.cat([sample_uniforms(0, 5, 0, 2, 7, torch.device("cpu")),
                        sample_uniforms(0, 5, 2, 2, 7, torch.device("cpu"))])
    assert torch.equal(whole, halves) and not torch.equal(whole, sample_uniforms(0, 6, 0, 4, 7, torch.device("cpu")))


@pytest.mark.parametrize("kwargs, key", [
    ({"mlm_weight": -0.1}, "model.init_args.mlm_weight"),
    ({"itm_weight": -1.0}, "model.init_args.itm_weight"),
    ({"mlm_mask_ratio": 0.0}, "model.init_args.mlm_mask_ratio"),
    ({"mlm_mask_ratio": 1.0}, "model.init_args.mlm_mask_ratio"),
    ({"mlm_random_share": 0.3}, "model.init_args.mlm_random_share"),
    ({"contrastive_chunk_size": 2}, "model.init_args.contrastive_chunk_size"),
    ({"lora": {"r": 2}}, "model.init_args.lora"),
])
def test_bad_options_are_refused_naming_the_key(micro_json, kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        CLIPMLM(model_name=micro_json, **kwargs)


def test_a_causal_or_maskless_text_tower_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no_causal_mask: true"):
        CLIPMLM(model_name=_json(tmp_path, no_causal_mask=None))
    with pytest.raises(ValueError, match="set text_cfg.vocab_size to 49409"):
        CLIPMLM(model_name=_json(tmp_path, vocab_size=49408))


def test_two_processes_log_the_validation_figures_of_one(tmp_path, tiny_demo, micro_json):
    """configs/demo/clip_mlm.yaml, lr 0, one validation shard (rank 1 has no batch): 2 DDP ranks
    (training through the gathered negatives and the all-reduced MLM count) log the retrieval,
    zero-shot, masked-word and matching figures of 1 process."""
    val = f"{os.path.dirname(tiny_demo.val)}/0.tar"
    figures = []
    for processes in (1, 2):
        folder = tmp_path / f"p{processes}"
        folder.mkdir()
        args = [
            "fit", "--config", str(REPO / "configs/demo/clip_mlm.yaml"), f"--model.init_args.model_name={micro_json}",
            f"--data.init_args.demo_dir={tiny_demo.root}", f"--data.init_args.val_data={val}",
            "--data.init_args.batch_size=4", "--data.init_args.num_workers=2",
            "--model.init_args.optimizer.init_args.lr=0.0", "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=2", "--trainer.log_every_n_steps=1",
            f"--trainer.default_root_dir={folder / 'runs'}", "--trainer.enable_progress_bar=false",
        ]
        if processes == 2:
            args += ["--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), PG_TIMEOUT]
        out = run_mmssl(args, folder) if processes == 2 else run_one_process(args)
        assert out.returncode == 0, out.stdout[-3000:]
        assert "sync_dist=True" not in out.stdout, out.stdout[-3000:]
        run = folder / "runs" / "version_0"
        figures.append(last_metrics(run))
        train = last_metrics(run, ("train/",))
        assert torch.isfinite(torch.tensor([train["train/mlm_loss"], train["train/itm_loss"]])).all(), train
    one, two = figures
    expected = {"val/loss", "val/mlm_top1", "val/mlm_loss", "val/itm_accuracy", "val/itm_loss",
                "val/contrastive_loss", "val/i2t_R@1", "val/t2i_R@1", "val/zero_shot_top1"}
    assert expected <= one.keys() and one.keys() == two.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-5), key


def test_hugging_face_tokenizer_brings_its_own_mask_token_or_is_refused():
    from types import SimpleNamespace

    from mmssl.models.token_masking import mask_vocabulary

    class Tok(list):  # len() is the vocabulary, as a transformers tokenizer's
        name_or_path, all_special_ids = "local/bert", [0, 101, 102, 103]

    bert = Tok(range(30522))
    bert.mask_token_id = 103
    voc = mask_vocabulary(SimpleNamespace(tokenizer=bert), 30522)
    assert voc.mask_id == 103 and voc.random_vocab == 30522 and voc.never_masked == (0, 101, 102) and voc.eot_id is None
    bert.mask_token_id = None
    with pytest.raises(ValueError, match="'local/bert' has no mask token"):
        mask_vocabulary(SimpleNamespace(tokenizer=bert), 30522)


BATCH8 = [f"a {size} {colour} {shape}" for size in ("small", "big") for colour in ("red", "blue")
          for shape in ("circle", "square")]
BATCH8[4:] = [c + " in the top left corner on a plain white background" for c in BATCH8[4:]]  # 2 chosen each
BATCH8[5] = BATCH8[1]  # a repeated caption on the other rank: never the negative of its twin


def _exact_terms(micro_json: str, rows: slice) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Loss terms (mean over ranks) and gradients (mean over ranks, as DDP's) of ``rows`` of the batch."""
    model = _model(micro_json).train()
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1))[rows]
    terms = model.losses(images, model.tokenizer(BATCH8)[rows])  # contrastive, mlm, itm (weights 1)
    sum(terms).backward()
    values = torch.stack([sum(terms).detach(), *(t.detach() for t in terms)])
    grads = {n: p.grad for n, p in model.named_parameters()}
    if dist.is_initialized():
        dist.all_reduce(values)
        values /= dist.get_world_size()
        for grad in grads.values():
            dist.all_reduce(grad)
            grad /= dist.get_world_size()
    return dict(zip(("loss", "contrastive", "mlm", "itm"), values.tolist())), grads


def _exact_worker(local_rank: int, init_file: str, micro_json: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=local_rank, world_size=2)
    torch.save(_exact_terms(micro_json, slice(4 * local_rank, 4 * local_rank + 4)), f"{out_file}.{local_rank}")
    dist.destroy_process_group()


def test_two_ranks_train_as_one_process_on_the_concatenated_batch(tmp_path, micro_json):
    """The gathered negatives (drawn per global sample), the MLM token mean over ranks and the
    ITM pairs fused where their image lives: loss terms and every gradient equal one process's."""
    mp.start_processes(_exact_worker, args=(str(tmp_path / "init"), micro_json, str(tmp_path / "out")),
                       nprocs=2, start_method="fork")
    one_terms, one_grads = _exact_terms(micro_json, slice(0, 8))
    for r in range(2):
        terms, grads = torch.load(tmp_path / f"out.{r}", weights_only=False)
        for key in one_terms:
            assert terms[key] == pytest.approx(one_terms[key], rel=1e-5, abs=1e-6), key
        for name, grad in one_grads.items():
            assert torch.allclose(grads[name], grad, rtol=1e-4, atol=1e-6), name


def test_one_text_tower_call_gives_what_two_calls_gave(micro_json):
    """``losses`` runs the clean and the corrupted captions through one text-tower call (so each
    FSDP2 unit runs once a step, and the root's forward is the step's last): loss terms and every
    gradient are those of the clean captions through ``encode_text`` and the corrupted ones
    through a call of their own."""
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    figures = []
    for joint in (True, False):
        model = _model(micro_json, mlm_weight=0.7, itm_weight=0.3).train()
        tokens = model.tokenizer(CAPTIONS)
        length = tokens.shape[1]
        uniforms = model.uniforms(images, 3 * length + 8, training=True)  # masking first, then 2N negatives
        masking = model.mask_captions(tokens, uniforms[:, :3 * length].reshape(4, length, 3))
        if joint:
            contrastive, mlm, itm = model.losses(images, tokens)
            terms = {"loss": contrastive + mlm + itm, "contrastive": contrastive, "mlm": mlm / 0.7, "itm": itm / 0.3}
            with torch.no_grad():
                out = model(images, tokens, masking.input_ids)
            assert out["masked_states"].shape == (4, length, 32)
        else:  # the two calls, by hand, on the same draws
            out = model(images, tokens)
            assert "masked_states" not in out
            batch = {"mlm_labels": masking.labels, "mlm_selected": masking.selected}
            states = model.forward_text_tokens(masking.input_ids)  # the tower on the corrupted captions alone
            ce_sum, _, count = model.objectives["mlm"].sums(states, batch)
            itm_sum, _, _ = itm_sums(model.itm_head, out, tokens, uniforms[:, 3 * length:], gathered=True)
            contrastive, mlm, itm = model.contrastive_loss(out), ce_sum / count, itm_sum / 12
            terms = {"loss": contrastive + 0.7 * mlm + 0.3 * itm, "contrastive": contrastive, "mlm": mlm, "itm": itm}
        terms["loss"].backward()
        assert set(out) >= {"image_features", "text_features", "logit_scale", "image_tokens"}
        figures.append(({k: float(terms[k].detach()) for k in ("loss", "contrastive", "mlm", "itm")},
                        {n: p.grad for n, p in model.named_parameters()}, out["text_features"].detach()))
    (joint_terms, joint_grads, joint_text), (two_terms, two_grads, two_text) = figures
    assert joint_terms["mlm"] > 0 and joint_terms["itm"] > 0
    for key in two_terms:
        assert joint_terms[key] == pytest.approx(two_terms[key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(joint_text, two_text, rtol=1e-5, atol=1e-6)
    for name, grad in two_grads.items():
        torch.testing.assert_close(joint_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
