"""SigLIP 2's late terms in process: self-distillation (``self_distill``) and masked prediction
(``masked_features``) against hand computations on constructed tiny cases, Sinkhorn-Knopp and the
DINO head by hand, the 0 weight before the start (the draws and the graph unchanged across it), what
is refused at start-up, and the data module's local crops (seeded per sample, the global crop
unchanged)."""

from __future__ import annotations

import io
import math
import random
import types

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from mmssl.data.datamodule import ImageTextDataModule, LocalCropDecoder
from mmssl.data.decode import SampleDecoder
from mmssl.errors import ConfigError
from mmssl.export.checkpoint import to_open_clip
from mmssl.models.clip import CLIP
from mmssl.objectives import OBJECTIVES, MaskedFeatures, SelfDistillation
from mmssl.objectives.self_distill import DINOHead, sinkhorn_knopp
from tests.helpers import as_two_thread_ranks

HEAD = {"out_dim": 8, "hidden_dim": 16, "bottleneck_dim": 4}


def _sinkhorn_by_hand(logits: list[list[float]], temperature: float, iterations: int = 3) -> list[list[float]]:
    """DINOv2's sinkhorn_knopp_teacher written with lists: Q = exp(l / t) (K x N), normalised to
    sum 1, then each prototype's row to 1 / K and each sample's column to 1 / N, times N."""
    n, k = len(logits), len(logits[0])
    q = [[math.exp(logits[j][i] / temperature) for j in range(n)] for i in range(k)]  # (K, N)
    total = sum(map(sum, q))
    q = [[v / total for v in row] for row in q]
    for _ in range(iterations):
        q = [[v / sum(row) / k for v in row] for row in q]
        cols = [sum(q[i][j] for i in range(k)) for j in range(n)]
        q = [[q[i][j] / cols[j] / n for j in range(n)] for i in range(k)]
    return [[q[i][j] * n for i in range(k)] for j in range(n)]  # (N, K)


def _cross_entropy_by_hand(student: list[float], target: list[float], temperature: float) -> float:
    """-sum_k target_k log softmax(student / t)_k."""
    logits = [s / temperature for s in student]
    log_z = math.log(sum(math.exp(v) for v in logits))
    return -sum(t * (v - log_z) for t, v in zip(target, logits))


def test_sinkhorn_knopp_is_dinov2s():
    logits = [[0.3, -0.2, 0.9], [0.1, 0.5, -0.7]]  # 2 samples, 3 prototypes
    got = sinkhorn_knopp(torch.tensor(logits), 0.5)
    torch.testing.assert_close(got, torch.tensor(_sinkhorn_by_hand(logits, 0.5)), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum(dim=1), torch.ones(2))


def test_sinkhorn_knopp_on_two_ranks_is_one_process_on_their_rows(monkeypatch):
    """Two ranks as two threads, all_reduce a sum through a barrier: the teacher's targets of each
    rank's rows are one process's on the concatenated rows, not those of its rows alone."""
    logits = torch.randn(8, 5, generator=torch.Generator().manual_seed(0))
    out = as_two_thread_ranks(monkeypatch, lambda r: sinkhorn_knopp(logits[4 * r:4 * r + 4], 0.5, distributed=True))
    whole = sinkhorn_knopp(logits, 0.5)
    torch.testing.assert_close(torch.cat(out), whole)
    assert not torch.allclose(sinkhorn_knopp(logits[:4], 0.5), whole[:4], atol=1e-3)  # the global batch counts


@pytest.mark.parametrize("name", ["self_distill", "masked_features"])
def test_a_training_step_centres_the_teachers_targets_over_every_rank_and_validation_over_its_own(
        name, siglip2, monkeypatch):
    """Under DDP the teacher's targets of a training step are Sinkhorn-Knopp over the global batch
    (its sums all-reduced); a validation batch, which another rank may not have, is centred alone
    (no collective). Counted on one process posing as a rank of a group: the all-reduces each
    prepare makes."""
    import mmssl.objectives.masked_features as masked_module
    import mmssl.objectives.self_distill as self_distill_module

    calls = []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, *a, **k: calls.append(tensor.shape))
    for module in (self_distill_module, masked_module):
        monkeypatch.setattr(module, "is_distributed", lambda: True)
    objective = siglip2.objectives[name]
    generator = torch.Generator().manual_seed(5)
    batch = {"image": torch.randn(2, 3, 32, 32, generator=generator), "text": torch.randint(1, 99, (2, 16)),
             "local_crops": torch.randn(2, 2, 3, 32, 32, generator=generator)}
    uniforms = torch.rand(2, objective.draws(batch, True), generator=generator)
    calls.clear()
    objective.prepare(siglip2, batch, uniforms, training=True)
    assert len(calls) >= 3, calls  # the total, then a column sum at each of the 3 iterations
    calls.clear()
    objective.prepare(siglip2, batch, uniforms, training=False)
    assert calls == []


def test_the_dino_head_is_cosines_to_normalised_prototypes():
    torch.manual_seed(0)
    head = DINOHead(5, 7, hidden_dim=6, bottleneck_dim=3)
    x = torch.randn(4, 5)
    z = head.mlp[4](F.gelu(head.mlp[2](F.gelu(head.mlp[0](x)))))  # three linear layers, GELU between
    expected = (z / z.norm(dim=1, keepdim=True)) @ (head.prototypes / head.prototypes.norm(dim=1, keepdim=True)).t()
    torch.testing.assert_close(head(x), expected)
    assert [type(m).__name__ for m in head.mlp] == ["Linear", "GELU", "Linear", "GELU", "Linear"]


class _Host(nn.Module):
    """A host whose image tower is given: the teacher's pooled (B, E) and patch (B, L, D) features,
    its masking MAE's rule on the uniforms (the smallest half kept)."""

    def __init__(self, objectives: dict[str, nn.Module], pooled: torch.Tensor, patches: torch.Tensor) -> None:
        super().__init__()
        self.objectives = nn.ModuleDict(objectives)
        self.pooled, self.patches = pooled, patches

    def forward(self, images, tokens, teacher_targets=False):
        assert teacher_targets
        return {"pooled": self.pooled, "patches": self.patches}

    def mask_patches(self, noise, ratio):
        return CLIP.mask_patches(self, noise, ratio)


def test_self_distillation_by_hand():
    """Two images, two local crops each; the heads are identities, so the teacher's targets are
    Sinkhorn-Knopp of its pooled features / 0.07 and each crop is scored against its own image's."""
    objective = SelfDistillation(weight=0.5, start=0, **HEAD)
    objective.head = nn.Identity()
    pooled = torch.tensor([[0.2, -0.4, 0.6], [0.5, 0.1, -0.3]])  # (B=2, K=3)
    local = torch.tensor([[0.1, 0.2, 0.3], [-0.5, 0.4, 0.0], [0.9, -0.1, 0.2], [0.0, 0.0, 0.7]])  # (B*n, K)
    host = _Host({"self_distill": objective}, pooled, torch.zeros(2, 4, 3))
    batch = {"image": torch.zeros(2, 3, 8, 8), "text": torch.zeros(2, 4, dtype=torch.long),
             "local_crops": torch.zeros(2, 2, 3, 8, 8)}
    added = objective.prepare(host, batch, None, training=True)
    assert added["local_crops"] is batch["local_crops"]  # the forward's input
    targets = _sinkhorn_by_hand(pooled.tolist(), 0.07)
    torch.testing.assert_close(added["self_distill_targets"], torch.tensor(targets), rtol=1e-5, atol=1e-7)
    term = objective({"local_features": local}, {**batch, **added}, weight=0.5)
    crops = [_cross_entropy_by_hand(local[i].tolist(), targets[i // 2], 0.1) for i in range(4)]  # image i // 2
    assert term.item() == pytest.approx(0.5 * sum(crops) / 4, rel=1e-5)
    assert objective.validation({"local_features": local}, {**batch, **added}).item() == \
        pytest.approx(sum(crops) / 4, rel=1e-5)


def test_masked_prediction_by_hand():
    """One image of 4 patches, half masked by its uniforms (the two largest: patches 1 and 3): the
    student's features at those two against Sinkhorn-Knopp of the teacher's there; the rest ignored."""
    objective = MaskedFeatures(weight=2.0, start=0, mask_ratio=0.5, **HEAD)
    objective.head = nn.Identity()
    teacher = torch.tensor([[[0.1, 0.2], [0.7, -0.3], [5.0, 5.0], [-0.4, 0.8]]])  # (1, L=4, K=2)
    student = torch.tensor([[[9.0, 9.0], [0.3, 0.1], [9.0, -9.0], [-0.2, 0.6]]])
    host = _Host({"masked_features": objective}, torch.zeros(1, 2), teacher)
    batch = {"image": torch.zeros(1, 3, 8, 8), "text": torch.zeros(1, 4, dtype=torch.long)}
    uniforms = torch.tensor([[0.1, 0.9, 0.2, 0.8]])
    added = objective.prepare(host, batch, uniforms, training=True)
    assert added["patch_mask"].tolist() == [[False, True, False, True]]
    targets = _sinkhorn_by_hand([teacher[0, 1].tolist(), teacher[0, 3].tolist()], 0.07)
    torch.testing.assert_close(added["masked_features_targets"], torch.tensor(targets), rtol=1e-5, atol=1e-7)
    term = objective({"masked_patches": student}, {**batch, **added}, weight=2.0)
    rows = [_cross_entropy_by_hand(student[0, p].tolist(), targets[i], 0.1) for i, p in enumerate((1, 3))]
    assert term.item() == pytest.approx(2.0 * sum(rows) / 2, rel=1e-5)


@pytest.fixture(scope="module")
def siglip2(tiny_coca_json) -> CLIP:
    torch.manual_seed(0)
    return CLIP(model_name=tiny_coca_json, loss="siglip", objectives={
        "caption": {}, "self_distill": {"start": 0.5, **HEAD}, "masked_features": {"start": 0.5, **HEAD}})


def _attach(model: CLIP, step: int = 0, total: int = 10, callbacks=(), datamodule=None) -> None:
    model._trainer = types.SimpleNamespace(global_step=step, estimated_stepping_batches=total,
                                           callbacks=list(callbacks), datamodule=datamodule)


def _step(model: CLIP, step: int):
    _attach(model, step)
    generator = torch.Generator().manual_seed(3)
    batch = {"image": torch.randn(2, 3, 32, 32, generator=generator), "text": torch.randint(1, 99, (2, 16)),
             "local_crops": torch.randn(2, 2, 3, 32, 32, generator=generator)}
    try:
        out, batch = model.step_forward(batch, training=True)
        return model.objective_terms(out, batch), batch
    finally:
        model._trainer = None


def test_before_their_start_the_terms_weigh_0_and_draw_and_run_alike(siglip2):
    assert list(OBJECTIVES)[-3:] == ["self_distill", "masked_features", "masked_image"]  # the last terms and draws
    before, batch_before = _step(siglip2, 4)  # start 0.5 of 10 steps: step 5
    after, batch_after = _step(siglip2, 5)
    assert before["self_distill"].item() == before["masked_features"].item() == 0.0
    assert after["self_distill"].item() > 0 and after["masked_features"].item() > 0
    assert batch_before["patch_mask"].sum() == 2 * 8  # half of each image's 16 patches
    siglip2.zero_grad()
    sum(before.values()).backward()  # in the graph before the start: DDP sees every parameter
    heads = [p for n, p in siglip2.named_parameters() if n.startswith("objectives.")]
    assert heads and all(p.grad is not None and not p.grad.any() for p in heads)
    # The masks of a step do not depend on the weight: the same draws whichever the start.
    _, again = _step(siglip2, 4)
    assert torch.equal(again["patch_mask"], batch_before["patch_mask"])
    siglip2.zero_grad()


def test_the_student_sees_the_mask_token_at_masked_patches_only(siglip2):
    siglip2.eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    mask = torch.zeros(2, 16, dtype=torch.bool)
    clean = siglip2.masked_patch_tokens(images, mask)
    torch.testing.assert_close(clean, siglip2.image_targets(images)["patches"])  # nothing masked: the teacher's view
    mask[0, 3] = True
    masked = siglip2.masked_patch_tokens(images, mask)
    assert torch.equal(masked[1], clean[1]) and not torch.allclose(masked[0], clean[0])
    other = images.clone()
    other[0, :, 0:8, 24:32] = 7.0  # patch 3's pixels: hidden behind the mask token
    torch.testing.assert_close(siglip2.masked_patch_tokens(other, mask)[0], masked[0])
    # Every patch masked: the tokens still differ by position (iBOT: the token, then the position
    # embedding); identical inputs would give identical tokens.
    hidden = siglip2.masked_patch_tokens(images, torch.ones(2, 16, dtype=torch.bool))
    assert not torch.allclose(hidden[0, 0], hidden[0, 5])
    torch.testing.assert_close(hidden[0], hidden[1])  # the pixels are all hidden: both images alike
    siglip2.train()


def test_a_run_without_the_ema_or_the_local_crops_is_refused_at_start_up(siglip2):
    ema = types.SimpleNamespace(averaged_module=lambda: None)
    _attach(siglip2, datamodule=types.SimpleNamespace(local_crops=2))
    with pytest.raises(ConfigError, match=r"objectives\.self_distill: .*no mmssl\.callbacks\.EMA callback"):
        siglip2.setup("fit")
    _attach(siglip2, callbacks=[ema], datamodule=types.SimpleNamespace(local_crops=0))
    with pytest.raises(ConfigError, match=r"needs the batch field 'local_crops'.*set data\.init_args\.local_crops"):
        siglip2.setup("fit")
    _attach(siglip2, callbacks=[ema], datamodule=types.SimpleNamespace(local_crops=2))
    siglip2.setup("fit")
    siglip2._trainer = None


def test_fsdp2_is_refused_at_start_up_naming_the_objective(siglip2, tiny_coca_json):
    """Under FSDP2 the EMA teacher's copy and the heads run outside the sharded forward and their
    all-gathers do not pair up across ranks (a gloo size mismatch at the first step): refused at
    start-up in one line naming the key instead; an objective weighted 0 is no reason."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import ModelParallelStrategy

    from mmssl.sharding import shard_model

    with pytest.raises(ValueError, match=r"CLIP under ModelParallelStrategy \(FSDP2\): "
                       r"model.init_args.objectives.self_distill: the EMA teacher .* train it with DDP"):
        shard_model(siglip2, SimpleNamespace(strategy=ModelParallelStrategy()))
    only_masked = CLIP(model_name=tiny_coca_json, loss="siglip",
                       objectives={"self_distill": {"weight": 0.0}, "masked_features": HEAD})
    assert only_masked.sharding_refusal().startswith("model.init_args.objectives.masked_features: ")
    plain = CLIP(model_name=tiny_coca_json, loss="siglip", objectives={"self_distill": {"weight": 0.0}})
    assert plain.sharding_refusal() is None


def test_refused_options(tiny_coca_json):
    with pytest.raises(ConfigError, match=r"objectives\.masked_features: FLIP drops"):
        CLIP(model_name=tiny_coca_json, loss="siglip", flip={"mask_ratio": 0.5},
             objectives={"masked_features": HEAD})
    with pytest.raises(ConfigError, match=r"objectives\.masked_features\.mask_ratio"):
        MaskedFeatures(mask_ratio=1.0)
    with pytest.raises(ConfigError, match=r"objectives\.self_distill\.teacher_temp"):
        SelfDistillation(teacher_temp=0)
    with pytest.raises(ValueError, match=r"data\.init_args\.local_crops"):
        ImageTextDataModule(local_crops=2, train_augment={"auto_augment": "rand-m9-mstd0.5"})
    with pytest.raises(ValueError, match=r"data\.init_args\.local_crops must"):
        ImageTextDataModule(local_crops=-1)


def _sample() -> dict:
    image = Image.fromarray(torch.randint(0, 255, (48, 40, 3), generator=torch.Generator().manual_seed(0),
                                          dtype=torch.uint8).numpy())
    data = io.BytesIO()
    image.save(data, format="PNG")
    return {"__key__": "k0", "__url__": "/x/0.tar", "png": data.getvalue(), "txt": b"a red square"}


def _decoder(local_crops: int, train: bool = True):
    module = ImageTextDataModule(image_size=16, local_crops=local_crops, crop_scale=(0.5, 1.0),
                                 tokenizer=lambda captions: torch.ones(len(captions), 4, dtype=torch.long))
    return module._decoder(train)


def test_local_crops_are_seeded_per_sample_after_the_global_crop():
    plain, local = _decoder(0), _decoder(3)
    assert type(plain) is SampleDecoder and isinstance(local, LocalCropDecoder)
    first = local(_sample(), random.Random("s"))
    again = local(_sample(), random.Random("s"))
    assert first["local_crops"].shape == (3, 3, 16, 16) and first["local_crops"].dtype == torch.uint8
    assert torch.equal(first["local_crops"], again["local_crops"])  # a resume crops alike
    assert torch.equal(first["image"], plain(_sample(), random.Random("s"))["image"])  # drawn first: unchanged
    assert not torch.equal(first["local_crops"][0], first["local_crops"][1])
    batch = local.collate([first, again])
    assert batch["local_crops"].shape == (2, 3, 3, 16, 16) and batch["local_crops"].dtype == torch.float32
    val = _decoder(2, train=False)
    assert torch.equal(val(_sample())["local_crops"], val(_sample())["local_crops"])  # no RNG: a fixed seed


def test_the_open_clip_export_leaves_the_heads_and_mask_token_out_and_embeds_alike(siglip2, tiny_coca_json):
    """SigLIP 2's module exports as its CoCa towers: the DINO heads and the mask token stay behind,
    the file loads strictly into open_clip's model of the same config and embeds bit for bit alike."""
    siglip2.eval()
    exported = to_open_clip(siglip2.state_dict())
    assert not any(k.startswith("objectives") or "mask_token" in k or "prototypes" in k for k in exported)
    towers = CLIP(model_name=tiny_coca_json, loss="siglip").model.eval()
    towers.load_state_dict(exported)  # strict
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(1, 99, (2, 16))
    with torch.no_grad():
        assert torch.equal(towers.encode_image(images), siglip2.model.encode_image(images))
        assert torch.equal(towers.encode_text(tokens), siglip2.model.encode_text(tokens))
    siglip2.train()
