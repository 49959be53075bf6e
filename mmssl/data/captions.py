"""Captions made from class labels: FLYP's training text (Goyal et al. 2022, "Finetune like you
pretrain").

FLYP fine-tunes CLIP with its own contrastive loss on a labelled set whose captions are the class
prompts: ``locuslab/FLYP`` ``datacreation_scripts/imagenet_csv_creator.py`` writes one row per
(image, template) with ``template(classname)`` as the caption, and the training loop draws
shuffled rows, so each time an image is seen it comes with one of its class's prompts at random.
Here each sample's template is drawn from the sample's own augmentation RNG (a function of the
data seed, epoch, shard and key: :func:`mmssl.data.pipeline.augmentation_rng`), after its crop, so
a resumed run draws the same captions as an uninterrupted one and the crops are those of a run
without class captions. Validation samples (no RNG) take a template fixed by their key.
"""

from __future__ import annotations

import os
import random
from typing import Optional, Sequence

from mmssl.data.decode import BadSample
from mmssl.data.label_files import DEFAULT_TEMPLATES, TEMPLATES_FILE, read_classnames, read_templates


class ClassCaptions:
    """Label -> caption ``template.format(c=classnames[label])``, the template drawn per sample.

    Args:
        classnames: class names in label order.
        templates: prompt templates with a ``{c}`` placeholder.
        source: where the names came from, named in errors.
    """

    def __init__(self, classnames: Sequence[str], templates: Sequence[str], source: str = "class names") -> None:
        if not classnames or not templates:
            raise ValueError(f"{source}: class captions need at least one class name and one template")
        self.classnames, self.templates, self.source = tuple(classnames), tuple(templates), source

    def caption(self, label: Optional[int], rng: Optional[random.Random], key: object = None) -> str:
        """The caption of one sample.

        Args:
            label: its class (``None``: the sample has no class label).
            rng: the sample's augmentation RNG (training); ``None`` picks the template from ``key``.
            key: the sample's ``__key__`` (validation's fixed choice).

        Raises:
            BadSample: no label, or a label without a class name.
        """
        if label is None:
            raise BadSample("no class label to make a caption from (data.captions_from_classes needs 'cls')")
        if not 0 <= label < len(self.classnames):
            raise BadSample(f"label {label} has no class name ({len(self.classnames)} in {self.source})")
        rng = rng if rng is not None else random.Random(f"caption/{key}")
        template = self.templates[rng.randrange(len(self.templates))]
        return template.format(c=self.classnames[label])


def class_captions(classnames: str, templates: Optional[str] = None) -> ClassCaptions:
    """The captions of ``data.captions_from_classes`` / ``data.caption_templates``.

    Args:
        classnames: a class-names file (one name a line, in label order), or a labelled set (a
            folder of shards or a clip_benchmark set with ``classnames.txt``, or a class folder).
        templates: a templates file (one prompt a line with ``{c}``); ``None``: the
            ``zeroshot_classification_templates.txt`` beside the class names, else CLIP's 80
            ImageNet prompts (FLYP's ImageNet recipe, ``--template=openai_imagenet_template``).

    Raises:
        FileNotFoundError: no class-names file (the paths tried named) or templates file.
        ValueError: a bad class-names or templates file (file and line named).
    """
    key = "data.init_args.captions_from_classes"
    classnames = os.path.expanduser(classnames)
    templates = os.path.expanduser(templates) if templates else None
    try:
        if os.path.isfile(classnames):
            folder = os.path.dirname(os.path.abspath(classnames))
            names = read_classnames(folder, classnames)
            beside = os.path.join(folder, TEMPLATES_FILE)  # the set's own prompts, as labeled.py names them
            templates = templates or (beside if os.path.isfile(beside) else None)
            prompts = read_templates(folder, templates) if templates else list(DEFAULT_TEMPLATES)
        else:
            if not os.path.exists(classnames):
                raise FileNotFoundError(f"no class-names file or labelled set at {classnames!r}")
            names, prompts = read_classnames(classnames), read_templates(classnames, templates)
    except (FileNotFoundError, ValueError) as err:
        cls = FileNotFoundError if isinstance(err, FileNotFoundError) else ValueError
        raise cls(f"{key}={classnames!r}: {err}") from None
    return ClassCaptions(names, prompts, classnames)
