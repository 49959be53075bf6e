"""Tiny models shared by the tests, as init arguments (``MAE(**TINY_MAE)``) and as command-line flags.

TINY_CLIP and TINY_COCA, the open_clip configs behind the ``tiny_clip_json`` / ``tiny_coca_json``
fixtures, live in ``tests/conftest.py`` with those fixtures.
"""

from __future__ import annotations

from typing import Any, Mapping

# A one-block MAE on 32x32 images, patch 8 (16 patches): a CPU step in milliseconds.
TINY_MAE: dict[str, Any] = dict(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=32,
                                decoder_depth=1, decoder_num_heads=2)


def tiny_mae(**changes: Any) -> dict[str, Any]:
    """TINY_MAE's init arguments with ``changes`` (``tiny_mae(depth=2)``)."""
    return {**TINY_MAE, **changes}


def model_flags(init_args: Mapping[str, Any]) -> list[str]:
    """``--model.init_args.KEY=VALUE`` for each of ``init_args``."""
    return [f"--model.init_args.{key}={value}" for key, value in init_args.items()]


# TINY_MAE's widths with two encoder blocks, over a recipe's own image and patch size (the demo
# recipes': 32 and 4): the MAE of the multi-process CLI tests.
TINY_MAE_FLAGS = model_flags({k: v for k, v in tiny_mae(depth=2).items() if k not in ("image_size", "patch_size")})
