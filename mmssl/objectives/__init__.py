"""How a model is trained: one pretext task per file, composed by name in a model's ``objectives``."""

from mmssl.objectives.base import (
    OBJECTIVES,
    Objective,
    build_objectives,
    build_part,
    check_parts,
    has_parts,
    register_part,
    sample_uniforms,
)
from mmssl.objectives.caption import Captioning
from mmssl.objectives.contrastive import LOSS_INIT, Contrastive, contrastive_loss
from mmssl.objectives.itm import ImageTextMatching, itm_sums, pick_negatives
from mmssl.objectives.masked_features import MaskedFeatures
from mmssl.objectives.masked_image import MaskedImageModelling
from mmssl.objectives.masked_text import MaskedLanguageModelling
from mmssl.objectives.self_distill import SelfDistillation

__all__ = ["LOSS_INIT", "OBJECTIVES", "Captioning", "Contrastive", "ImageTextMatching", "MaskedFeatures",
           "MaskedImageModelling", "MaskedLanguageModelling", "Objective", "SelfDistillation", "build_objectives",
           "build_part", "check_parts", "contrastive_loss", "has_parts", "itm_sums", "pick_negatives", "register_part",
           "sample_uniforms"]
