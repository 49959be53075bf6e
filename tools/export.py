"""Export an mmssl checkpoint for another library.

    python tools/export.py --ckpt runs/mae/checkpoints/last.ckpt --format timm --output vit.pth
    python tools/export.py --ckpt runs/clip/checkpoints/last.ckpt --format open_clip --output clip.pth
    python tools/export.py --ckpt runs/clip/checkpoints/last.ckpt --format hf --output clip_hf/
    python tools/export.py --ckpt runs/clip/checkpoints/last.ckpt --format open_clip_hf --output clip_oc/
    python tools/export.py --ckpt runs/clip_mlm/checkpoints/last.ckpt --format open_clip_hf --output clip_mlm_oc/
    python tools/export.py --ckpt runs/mae/checkpoints/last.ckpt --format timm --output vit_timm/
    python tools/export.py --ckpt runs/mae/checkpoints/last.ckpt --format timm --output vit_ema.pth --ema

``hf`` writes a transformers CLIPModel folder (needs ``pip install -e '.[hf]'``), ``open_clip_hf``
an open_clip hub folder (``local-dir:``), ``timm`` with a folder output a timm hub folder
(``model.safetensors`` + ``config.json``). Nothing is uploaded: ``huggingface-cli upload`` does that.

Which checkpoint exports to which format (``mmssl.checkpoints.layouts.KINDS``; any other pair is
refused, naming the formats the checkpoint has; tests/checkpoints/test_layouts.py checks this table):

    MAE              timm (file: encoder; folder)
    M3AE             timm (file: image encoder, its modality embedding folded in; folder)
    ImageClassifier  timm (file or folder, head included)
    CLIP             open_clip (file), open_clip_hf, hf (folders)
    CoCa             open_clip (file)
    CLIPMLM          open_clip (file), open_clip_hf (folder) (the CLIP alone: no MLM or ITM head, no mask row)

A CLIPMLM exports its CLIP: the towers, projections and logit scale, with the text tower's
``no_causal_mask`` (it was trained bidirectional) and without the mask token's embedding row, which
no caption's ids reach: ``text_cfg.vocab_size`` 49408, open_clip's BPE (the folder's
``open_clip_config.json`` says so; a file loads into the model config with that change). ``hf`` is
refused for it: transformers' CLIP text model is causal.

An existing output file, or a folder that is not empty, is refused unless ``--overwrite`` (which
replaces only a folder holding an earlier export's files); a refused export writes nothing.

The checkpoint is read as weights only: a file that pickles anything but tensors and plain data
is refused (mmssl.checkpoints).
"""

from __future__ import annotations

import argparse
import sys

from mmssl.evaluation.encoders import add_ema_argument
from mmssl.export import FORMATS, export_checkpoint
from mmssl.tools._common import run


def main(argv: list[str] | None = None) -> int:
    """Export ``--ckpt`` to ``--output``; the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint written by `mmssl fit`")
    parser.add_argument("--format", required=True, choices=FORMATS, help="target library")
    parser.add_argument("--output", required=True,
                        help="output file (.pth / .safetensors: timm, open_clip) or folder (hf, open_clip_hf, timm)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output file, or a folder holding an earlier export")
    add_ema_argument(parser)
    args = parser.parse_args(argv)

    def export() -> None:
        state = export_checkpoint(args.ckpt, args.format, args.output, overwrite=args.overwrite, ema=args.ema)
        print(f"wrote {len(state)} tensors ({args.format}) to {args.output}")

    return run("export", export)


if __name__ == "__main__":
    sys.exit(main())
