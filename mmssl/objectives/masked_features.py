"""Masked prediction of the EMA teacher's patch features (TIPS, Maninis et al. 2024; SigLIP 2,
Tschannen et al. 2025, arXiv 2502.14786, sec. 2.3): the student sees the image with half of its
patches replaced by a mask token and predicts the teacher's features of those patches.

SigLIP 2 sec. 2.3 (the values this objective and ``configs/siglip2/vit_b16.yaml`` take):
- 50% of the embedded image patches of the student are replaced by mask tokens (``mask_ratio``);
- the loss is defined as the self-distillation term's, on per-patch features instead of the pooled
  image representation, at the masked positions; student and teacher see the same view (the
  teacher unmasked);
- weight 0.25, times the model-size factor 0.25 for ViT-B: 0.0625; added for the last 20% of
  training (``start: 0.8``).

Where the paper is silent this follows TIPS / iBOT (Zhou et al. 2022) / DINOv2: the mask token is a
learned vector added in place of a patch's embedding, before the position embedding (iBOT; written
here as the token plus the patch's position embedding, the same sum, swapped in at the input of
the tower's ``ln_pre``); its own DINO head (:class:`~mmssl.objectives.self_distill.DINOHead`, as
DINOv2's separate iBOT head), the teacher's patch targets centred by Sinkhorn-Knopp over every
masked patch of the global batch (DINOv2's ``iBOTPatchLoss.sinkhorn_knopp_teacher``), the loss a
mean over the masked patches. Which patches are masked comes from the host's masking
(``host.mask_patches``: :func:`mmssl.models.masking.random_masking`, MAE's rule, exactly
``int(L x ratio)`` per image) ranked by the step's per-sample uniforms (:meth:`Objective.draws`), so N ranks mask what
one process masks and a resume masks again what it masked.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.distributed import is_distributed
from mmssl.errors import ConfigError
from mmssl.objectives.base import RowsObjective, image_width, register
from mmssl.objectives.self_distill import (
    DINOHead,
    check_head,
    distill_cross_entropy,
    find_teacher,
    require_ema,
    sinkhorn_knopp,
    teacher_features,
)


@register
class MaskedFeatures(RowsObjective):
    """TIPS's masked prediction of the EMA teacher's patch features (see the module docstring).

    Args:
        weight: the term's weight (SigLIP 2 sec. 2.3: 0.25 x 0.25 for ViT-B).
        start: see :class:`~mmssl.objectives.base.Objective` (SigLIP 2: 0.8).
        mask_ratio: share of each image's patches masked (SigLIP 2: 0.5).
        out_dim: the head's prototypes (DINO / iBOT: 65536 / 8192).
        hidden_dim: the head's MLP width (DINO: 2048).
        bottleneck_dim: the head's bottleneck (DINO: 256).
        student_temp: the student's temperature (iBOT: 0.1).
        teacher_temp: the teacher's temperature (DINOv2: 0.07).
    """

    name = "masked_features"
    order = 50  # last: its draws after every other objective's in each sample's stream
    host_parts = ("mask_patches",)  # the host's masking, in its own rule
    inputs = ("patch_mask",)
    chunked = False
    # Its EMA teacher is a copy of the whole module run beside the model's own forward, and its
    # head runs outside it: under FSDP2 the copy's and the head's all-gathers do not pair up across
    # ranks (measured: gloo "Received data size doesn't match expected size" at the first step on
    # 2 CPU ranks). Train it with DDP until both run inside one sharded forward.
    unsharded = ("the EMA teacher and its head are not sharded with FSDP2 yet; train it with DDP "
                 "(configs/trainer/ddp.yaml, ddp_cpu.yaml)")

    def __init__(self, weight: float = 0.0625, start: Union[int, float] = 0.8, mask_ratio: float = 0.5,
                 out_dim: int = 65536, hidden_dim: int = 2048, bottleneck_dim: int = 256, student_temp: float = 0.1,
                 teacher_temp: float = 0.07) -> None:
        super().__init__(weight, start)
        key = f"model.init_args.objectives.{self.name}"
        if not 0.0 < mask_ratio < 1.0:
            raise ConfigError(f"{key}.mask_ratio: in (0, 1), got {mask_ratio!r}")
        check_head(key, out_dim, hidden_dim, bottleneck_dim, student_temp, teacher_temp)
        self.mask_ratio = mask_ratio
        self.head_dims = (out_dim, hidden_dim, bottleneck_dim)
        self.student_temp, self.teacher_temp = student_temp, teacher_temp
        self.head: Optional[DINOHead] = None  # built in bind
        self.mask_token: Optional[nn.Parameter] = None  # (1, 1, D), read by the host's masked forward
        self.patches = 0
        self.val_loss = MeanMetric()

    def bind(self, model: nn.Module) -> None:
        width = image_width(model, self.name, "tokens")
        out_dim, hidden, bottleneck = self.head_dims
        self.head = DINOHead(width, out_dim, hidden, bottleneck)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        nn.init.trunc_normal_(self.mask_token, std=0.02)  # iBOT / DINOv2's mask token init
        self.patches = int(model.visual.positional_embedding.shape[0]) - 1  # L: the grid, without cls

    def check(self, host: nn.Module, model_name: str) -> None:
        if getattr(host, "image_mask_ratio", 0.0):
            raise ConfigError(f"model.init_args.objectives.{self.name}: FLIP drops image patches "
                              f"(model.init_args.flip.mask_ratio={host.image_mask_ratio}), so the masked view "
                              "loses its patch positions: set flip.mask_ratio: 0")

    def check_run(self, trainer: Any, stage: str) -> None:
        require_ema(self.name, trainer, stage)

    def draws(self, batch: Mapping[str, Tensor], training: bool) -> int:
        return self.patches  # one uniform per patch: its rank in the mask

    def prepare(self, host: nn.Module, batch: Mapping[str, Tensor], uniforms: Optional[Tensor],
                training: bool) -> dict[str, Tensor]:
        mask = host.mask_patches(uniforms, self.mask_ratio)  # (B, L) True: masked
        added = teacher_features(host, batch)
        patches = added.get("teacher_patches", batch.get("teacher_patches"))  # (B, L, D)
        teacher = find_teacher(host).objectives[self.name]  # the teacher's head: the EMA of the student's
        with torch.no_grad():
            targets = sinkhorn_knopp(teacher.head(patches[mask]), self.teacher_temp,
                                     distributed=training and is_distributed())  # (M, K)
        return {**added, "patch_mask": mask, "masked_features_targets": targets}

    def rows(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        """(M,) the cross-entropy of every masked patch of the student against the teacher's targets."""
        student = self.head(out["masked_patches"][batch["patch_mask"]])  # (M, K), row-major over (B, L)
        return distill_cross_entropy(student, batch["masked_features_targets"], self.student_temp)

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        return self.global_mean(self.rows(out, batch), weight)  # the global batch's patch mean

