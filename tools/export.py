"""Export an mmssl checkpoint for another library.

    python tools/export.py --ckpt runs/mae/checkpoints/last.ckpt --format timm --output vit.pth
    python tools/export.py --ckpt runs/clip/checkpoints/last.ckpt --format open_clip --output clip.pth

The checkpoint is read as weights only: a file that pickles anything but tensors and plain data
is refused (mmssl.checkpoints).
"""

from __future__ import annotations

import argparse

from mmssl.export import EXPORTERS, export_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint written by `mmssl fit`")
    parser.add_argument("--format", required=True, choices=sorted(EXPORTERS), help="target library")
    parser.add_argument("--output", required=True, help="output file (.pth, or .safetensors)")
    args = parser.parse_args(argv)
    state = export_checkpoint(args.ckpt, args.format, args.output)
    print(f"wrote {len(state)} tensors ({args.format}) to {args.output}")


if __name__ == "__main__":
    main()
