"""Self-distillation from local to global views (SILC, Naeem et al. 2023; SigLIP 2, Tschannen et al.
2025, arXiv 2502.14786, sec. 2.3): an EMA teacher sees the whole image, the student local crops
of it, and the student's features are pulled to the teacher's in the space of an auxiliary head.

SigLIP 2 sec. 2.3 (the values this objective and ``configs/siglip2/vit_b16.yaml`` take):
- the teacher's weights are an exponential moving average of the student's, and the term is added
  for the last 20% of training (``start: 0.8``), the teacher starting from the student's weights;
- the matching happens "in a separate feature space computed with an auxiliary MLP head";
- the term's weight is 1, times a model-size factor of 0.25 for ViT-B (0.5 L, 1.0 So400m, 0.5 g):
  0.25 for B/16.

Where the paper is silent this follows SILC, which follows DINO (Caron et al. 2021) / DINOv2
(Oquab et al. 2023):
- the head is DINO's (``DINOHead``: a 3-layer GELU MLP, a bottleneck, L2 normalisation and
  prototypes of norm 1), the loss DINO's cross-entropy between the teacher's distribution and the
  student's softmax at temperature 0.1 (DINO sec. 3.1);
- the teacher's distribution is centred by DINOv2's Sinkhorn-Knopp (3 iterations, temperature
  0.07; DINOv2 sec. 4 / ``dinov2/loss/dino_clstoken_loss.py``) rather than DINO's running centre:
  it keeps no state, so a resume is bit-exact without checkpointing a centre, and its sums over the
  batch are all-reduced, so N ranks centre the global batch as one process does;
- the teacher's head is the EMA of the student's (DINO); the heads are built with the model and
  sit out every optimizer step before their start (the host drops their gradients, 0 while the term
  weighs 0: ``CLIP.on_before_optimizer_step``), so at the 80% switch they are as initialised, with
  a fresh optimizer state, as the paper initialises them "and corresponding optimizer parameters"
  there, rather than decayed to nothing by 80% of the run's weight decay;
- the student's local crops come from the data module (``data.init_args.local_crops``), at the
  model's input size (DINO uses 96 px crops with interpolated position embeddings, which open_clip's
  image tower lacks), scale (0.05, 0.4) (DINO); the teacher's view is the training crop itself
  (SigLIP 2 gives the added terms augmented views of their own; here they share the batch's crop).

The teacher is the EMA that mmssl already keeps (:class:`mmssl.callbacks.EMA`): its averaged copy
of the whole module runs the image tower (no grad, eval mode) on the batch's images before the
student's forward, through the module's own forward (``teacher_targets=True``), so it is sharded as
the model is. The copy is run directly rather than swapping the average into the model: no weights
are copied per step and the model's parameters (and DDP's view of them) are never touched.
A run without the EMA callback is refused at start-up (:meth:`SelfDistillation.check_run`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.distributed import is_distributed
from mmssl.errors import ConfigError
from mmssl.objectives.base import RowsObjective, image_width, register


class DINOHead(nn.Module):
    """DINO's projection head (``dino/vision_transformer.py`` ``DINOHead``): an MLP of ``layers``
    linear layers with GELU, a ``bottleneck_dim`` output, L2 normalisation, then ``out_dim``
    prototypes of norm 1 (DINO's ``norm_last_layer``: weight normalisation with its gain fixed to 1,
    written as a normalised weight, which keeps one plain parameter for the EMA and for sharding).

    Written here because neither timm nor open_clip has one (lightly's ``DINOProjectionHead`` is the
    same, but lightly is no dependency of mmssl).

    Args:
        in_dim: input features.
        out_dim: prototypes K (DINO: 65536).
        hidden_dim: the MLP's width (DINO: 2048).
        bottleneck_dim: the MLP's output (DINO: 256).
        layers: linear layers of the MLP (DINO: 3).
    """

    def __init__(self, in_dim: int, out_dim: int, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 layers: int = 3) -> None:
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (layers - 1) + [bottleneck_dim]
        blocks: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            blocks.append(nn.Linear(a, b))
            if i < len(dims) - 2:
                blocks.append(nn.GELU())
        self.mlp = nn.Sequential(*blocks)
        self.prototypes = nn.Parameter(torch.empty(out_dim, bottleneck_dim))
        for module in self.mlp:
            if isinstance(module, nn.Linear):  # DINO's _init_weights
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        nn.init.trunc_normal_(self.prototypes, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        """(N, in_dim) -> (N, K) cosines between the normalised bottleneck and each prototype."""
        z = F.normalize(self.mlp(x), dim=-1)  # (N, bottleneck)
        return F.linear(z, F.normalize(self.prototypes, dim=-1))  # (N, K), each in [-1, 1]


def sinkhorn_knopp(logits: Tensor, temperature: float, iterations: int = 3, distributed: bool = False) -> Tensor:
    """The teacher's targets: DINOv2's ``sinkhorn_knopp_teacher`` (``dinov2/loss/dino_clstoken_loss.py``).

    Args:
        logits: (N, K) this rank's teacher outputs.
        temperature: the teacher's temperature (DINOv2: 0.07 after warm-up).
        iterations: Sinkhorn-Knopp iterations (DINOv2: 3).
        distributed: sum over every rank's rows (all-reduce), so the prototypes are balanced over
            the global batch; ``False`` in validation (no collective) or on one process.

    Returns:
        (N, K) targets, each row a distribution (sums to 1).
    """
    q = torch.exp(logits.float() / temperature).t()  # (K, N)
    n = torch.tensor(float(q.shape[1]), device=q.device)
    total = q.sum()
    if distributed:
        dist.all_reduce(n)
        dist.all_reduce(total)
    q = q / total
    k = q.shape[0]
    for _ in range(iterations):
        rows = q.sum(dim=1, keepdim=True)  # (K, 1): each prototype's mass over the global batch
        if distributed:
            dist.all_reduce(rows)
        q = q / rows / k
        q = q / q.sum(dim=0, keepdim=True) / n  # each sample's column to 1 / N
    return (q * n).t()  # (N, K)


def distill_cross_entropy(student: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """DINO's loss (sec. 3.1, eq. 2): per row ``-sum_k targets_k log softmax(student / temperature)_k``.

    Args:
        student: (N, K) the student head's outputs.
        targets: (N, K) the teacher's distributions.
        temperature: the student's temperature (DINO: 0.1).

    Returns:
        (N,) the cross-entropy of each row.
    """
    return -(targets * F.log_softmax(student.float() / temperature, dim=-1)).sum(dim=-1)


def find_teacher(host: nn.Module) -> nn.Module:
    """The EMA teacher of ``host``: the averaged copy kept by the trainer's EMA callback (any callback
    with an ``averaged_module``: objectives sit below the callbacks and import none). Outside a
    trainer, and in ``mmssl validate`` without an averaged copy, the module is its own teacher (what
    the EMA holds before its first update)."""
    trainer = getattr(host, "_trainer", None)
    for callback in getattr(trainer, "callbacks", None) or ():
        averaged = getattr(callback, "averaged_module", None)
        if callable(averaged):
            module = averaged()
            if module is not None:
                return module
    return host


def require_ema(name: str, trainer: Any, stage: str) -> None:
    """Refuse a ``fit`` whose trainer keeps no EMA of the weights, naming the objective."""
    if stage == "fit" and not any(callable(getattr(c, "averaged_module", None)) for c in trainer.callbacks):
        raise ConfigError(f"model.init_args.objectives.{name}: its teacher is the EMA of the weights, and the run "
                          "has no mmssl.callbacks.EMA callback: add one to trainer.callbacks")


def teacher_features(host: nn.Module, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The teacher's image features of the batch (no grad), once per step whichever objective asks
    first: ``teacher_pooled`` (B, E) and ``teacher_patches`` (B, L, D), and the teacher module."""
    if "teacher_pooled" in batch:
        return {}
    teacher = find_teacher(host)
    with torch.no_grad():
        out = teacher(batch["image"], batch["text"], teacher_targets=True)
    return {"teacher_pooled": out["pooled"].detach(), "teacher_patches": out["patches"].detach()}


def check_head(key: str, out_dim: int, hidden_dim: int, bottleneck_dim: int, student_temp: float,
               teacher_temp: float) -> None:
    """Refuse a DINO head's size that is no integer >= 1, or a temperature <= 0, naming ``key.option``."""
    for option, value in (("out_dim", out_dim), ("hidden_dim", hidden_dim), ("bottleneck_dim", bottleneck_dim)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key}.{option}: an integer >= 1, got {value!r}")
    for option, value in (("student_temp", student_temp), ("teacher_temp", teacher_temp)):
        if not value > 0:
            raise ConfigError(f"{key}.{option}: a temperature > 0, got {value!r}")


@register
class SelfDistillation(RowsObjective):
    """SILC's local-to-global consistency: local crops of the student against the EMA teacher's view
    of the whole image (see the module docstring for the values and their sources).

    Args:
        weight: the term's weight (SigLIP 2 sec. 2.3: 1 x 0.25 for ViT-B).
        start: see :class:`~mmssl.objectives.base.Objective` (SigLIP 2: 0.8).
        out_dim: the head's prototypes (DINO: 65536).
        hidden_dim: the head's MLP width (DINO: 2048).
        bottleneck_dim: the head's bottleneck (DINO: 256).
        student_temp: the student's temperature (DINO: 0.1).
        teacher_temp: the teacher's temperature (DINOv2: 0.07).
    """

    name = "self_distill"
    order = 40  # after the contrastive, caption, masked-text and matching terms; draws nothing
    inputs = ("local_crops",)
    chunked = False  # reads the whole batch's local-crop features at once
    fields = {"local_crops": "data.init_args.local_crops"}  # batch field -> the data module's key
    # Its EMA teacher is a copy of the whole module run beside the model's own forward, and its
    # head runs outside it: under FSDP2 the copy's and the head's all-gathers do not pair up across
    # ranks (measured: gloo "Received data size doesn't match expected size" at the first step on
    # 2 CPU ranks). Train it with DDP until both run inside one sharded forward.
    unsharded = ("the EMA teacher and its head are not sharded with FSDP2 yet; train it with DDP "
                 "(configs/trainer/ddp.yaml, ddp_cpu.yaml)")

    def __init__(self, weight: float = 0.25, start: Union[int, float] = 0.8, out_dim: int = 65536,
                 hidden_dim: int = 2048, bottleneck_dim: int = 256, student_temp: float = 0.1,
                 teacher_temp: float = 0.07) -> None:
        super().__init__(weight, start)
        key = f"model.init_args.objectives.{self.name}"
        check_head(key, out_dim, hidden_dim, bottleneck_dim, student_temp, teacher_temp)
        self.head_dims = (out_dim, hidden_dim, bottleneck_dim)
        self.student_temp, self.teacher_temp = student_temp, teacher_temp
        self.head: Optional[DINOHead] = None  # built in bind, from the image tower's width
        self.figures: dict[str, Tensor] = {}
        self.val_loss = MeanMetric()

    def bind(self, model: nn.Module) -> None:
        out_dim, hidden, bottleneck = self.head_dims
        self.head = DINOHead(image_width(model, self.name, "pooled"), out_dim, hidden, bottleneck)

    def check_run(self, trainer: Any, stage: str) -> None:
        require_ema(self.name, trainer, stage)
        check_fields(self.name, self.fields, trainer)

    def prepare(self, host: nn.Module, batch: Mapping[str, Tensor], uniforms: Optional[Tensor],
                training: bool) -> dict[str, Tensor]:
        added = teacher_features(host, batch)
        pooled = added.get("teacher_pooled", batch.get("teacher_pooled"))
        teacher = find_teacher(host).objectives[self.name]  # the teacher's head: the EMA of the student's
        with torch.no_grad():
            targets = sinkhorn_knopp(teacher.head(pooled), self.teacher_temp, distributed=training and is_distributed())
        return {**added, "self_distill_targets": targets, "local_crops": batch["local_crops"]}

    def rows(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """(B * n,) the cross-entropy of every local crop against its image's teacher targets."""
        crops = batch["local_crops"].shape[1]
        student = self.head(out["local_features"])  # (B * n, K), sample-major as local_crops.flatten(0, 1)
        targets = batch["self_distill_targets"].repeat_interleave(crops, dim=0)  # (B * n, K)
        return distill_cross_entropy(student, targets, self.student_temp)

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        # Every rank has the same number of crops: the mean over ranks is the global batch's mean.
        return weight * self.rows(out, batch).mean()



def check_fields(name: str, fields: Mapping[str, str], trainer: Any) -> None:
    """Refuse a run whose data module does not produce the objective's batch ``fields`` (field ->
    the data module's key that switches it on), naming the key."""
    datamodule = getattr(trainer, "datamodule", None)
    for field, key in fields.items():
        if not getattr(datamodule, key.rsplit(".", 1)[-1], None):
            raise ConfigError(f"model.init_args.objectives.{name}: needs the batch field {field!r}, which the data "
                              f"module does not produce: set {key} (e.g. 2)")
