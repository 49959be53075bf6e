"""How a model is trained: one pretext task per file, composed by name in a model's ``objectives``."""

from mmssl.objectives.base import OBJECTIVES, Objective, build_objectives, check_parts
from mmssl.objectives.caption import Captioning
from mmssl.objectives.contrastive import LOSS_INIT, Contrastive, contrastive_loss

__all__ = ["LOSS_INIT", "OBJECTIVES", "Captioning", "Contrastive", "Objective", "build_objectives", "check_parts",
           "contrastive_loss"]
