"""Shared fixtures: tiny shards written in the test, tiny model configs, a fast CPU setting."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from mmssl.data.demo import DemoData, ensure_demo_data

REPO = Path(__file__).resolve().parents[1]

# A CLIP small enough for a CPU test step in well under a second (the 49408-token embedding is
# fixed by the open_clip tokenizer; everything else is tiny).
TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(1)  # tests share 2 cores with data workers; oversubscription is slower


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Every test starts from the same global RNG state (torch, numpy, random): a draw from the
    global stream (a model's initialisation, an unseeded ``torch.randn``) then depends on the test
    alone, never on which tests ran before it. Tests still pass their own ``torch.Generator``
    where the figure they assert depends on the draw."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_demo(tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """A 96-sample demo set (64 train in 4 shards, 32 held-out in 2), 32x32 images."""
    root = tmp_path_factory.mktemp("demo")
    return ensure_demo_data(str(root), num_train=64, num_val=32, shard_size=16, image_size=32, seed=0)


@pytest.fixture(scope="session")
def tiny_clip_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a JSON open_clip config for a ~1.7M-parameter CLIP (1.6M of it the token table)."""
    path = tmp_path_factory.mktemp("models") / "clip_test_tiny.json"
    path.write_text(json.dumps(TINY_CLIP))
    return str(path)


# A CoCa of the same scale: open_clip's CoCa towers (attentional pooling, a class token on the
# text tower) and a one-layer multimodal decoder; embed_dim = text width = decoder width, as CoCa needs.
TINY_COCA = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8,
                   "attentional_pool": True, "attn_pooler_queries": 4, "attn_pooler_heads": 2, "output_tokens": True},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1,
                 "embed_cls": True, "output_tokens": True},
    "multimodal_cfg": {"context_length": 16, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1,
                       "attn_pooler_heads": 2},
    "custom_text": True,
}


@pytest.fixture(scope="session")
def tiny_coca_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of a JSON open_clip CoCa config (~1.6M parameters, nearly all the two token tables)."""
    path = tmp_path_factory.mktemp("models") / "coca_test_tiny.json"
    path.write_text(json.dumps(TINY_COCA))
    return str(path)
