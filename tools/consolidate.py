"""Write a sharded checkpoint folder (an FSDP2 run's) as one Lightning checkpoint file.

    python tools/consolidate.py --ckpt runs/demo_clip/version_0/checkpoints/last.ckpt --output last_full.ckpt

The folder (torch.distributed.checkpoint: ``.metadata``, one ``__R_0.distcp`` per rank, ``meta.pt``)
is read through mmssl's one reader, as data (``mmssl.checkpoints.read.read_dcp_folder``): whole
tensors, optimizer states numbered as ``Optimizer.state_dict()`` numbers them, ``meta.pt``'s entries
beside. torch's own ``dcp_to_torch_save`` unpickles the folder's entries with
``weights_only=False``, so it is not used. The file is what a DDP or one-device run saves: every tool
reads it, ``--ckpt_path`` resumes from it, and it can be shared as one file. Written atomically.
"""

import argparse
import os

from mmssl.checkpoints.io import atomic_torch_save
from mmssl.checkpoints.read import is_dcp_folder, read_dcp_folder
from mmssl.tools._common import run


def main(argv: list[str] | None = None) -> int:
    """Consolidate ``--ckpt`` into ``--output``; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a sharded checkpoint folder")
    parser.add_argument("--output", required=True, help="the checkpoint file to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = parser.parse_args(argv)
    return run("consolidate", lambda: _consolidate(args.ckpt, args.output, args.overwrite))


def _consolidate(ckpt: str, output: str, overwrite: bool) -> int:
    if not is_dcp_folder(ckpt):
        raise FileNotFoundError(f"--ckpt {ckpt!r} is no sharded checkpoint folder (no .metadata in it)")
    if os.path.isdir(output):
        raise IsADirectoryError(f"--output {output!r} is a folder: name the checkpoint file to write")
    if os.path.lexists(output) and not overwrite:
        raise FileExistsError(f"--output {output!r} exists: pass --overwrite to replace it")
    checkpoint = read_dcp_folder(ckpt)
    atomic_torch_save(checkpoint, output)
    print(f"wrote {len(checkpoint['state_dict'])} tensors and {len(checkpoint['optimizer_states'])} optimizer "
          f"state(s) at global_step {checkpoint.get('global_step')} to {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
