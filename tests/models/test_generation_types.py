"""mmssl.models.generation.generate: each generation type gets the caller's special ids and
parameters (beam search here, top-k / top-p through open_clip's ``CoCa.generate``), and an
unknown type is refused naming the ones there are."""

from __future__ import annotations

import pytest
import torch

from mmssl.models.coca import CoCa
from mmssl.models.generation import generate
from tests.models.test_beam_search import EOS, LONGEST, PAD, SOT, _exhaustive, _Table


def test_beam_search_is_run_with_the_callers_ids_and_parameters():
    model, images = _Table(6, seed=0), torch.arange(6)
    want = [_exhaustive(model, i, min_seq_len=1, length_penalty=0.0) for i in range(6)]
    got = generate(model, images, "beam_search", SOT, EOS, PAD, num_beams=16, seq_len=LONGEST + 3, min_seq_len=1,
                   length_penalty=0.0)
    width = max(len(c) for c in want)
    assert got.tolist() == [c + [PAD] * (width - len(c)) for c in want]
    assert any(len(c) < width for c in want)  # some caption is padded: PAD is seen


def _rows_to_end(ids: torch.Tensor, eos: int, pad: int) -> list[list[int]]:
    """Each caption up to its end-of-text, after checking that only padding follows it."""
    rows = []
    for row in ids.tolist():
        end = row.index(eos) + 1 if eos in row else len(row)
        assert all(t == pad for t in row[end:]), row
        rows.append(row[:end])
    return rows


def test_sampling_runs_open_clips_generate_with_the_callers_ids_and_parameters(tiny_coca_json):
    torch.manual_seed(0)
    coca = CoCa(tiny_coca_json, warmup_steps=0).eval()
    images = torch.randn(3, 3, 32, 32)
    ids = coca.generation_ids()
    sot, context = ids["sot_token_id"], coca.model.context_length
    with torch.no_grad():
        free = generate(coca.model, images, "top_k", sot, ids["eos_token_id"], ids["pad_token_id"], top_k=1,
                        seq_len=8, min_seq_len=3, max_seq_len=context)
    assert (free[:, 0] == sot).all()
    # An end-of-text id the greedy caption of image 0 emits at position 4 (after min_seq_len):
    # its caption ends there, padded with the pad id given.
    eos, pad = int(free[0, 4]), 7
    assert eos not in free[0, :4].tolist()
    with torch.no_grad():
        greedy = generate(coca.model, images, "top_k", sot, eos, pad, top_k=1, seq_len=8, min_seq_len=3,
                          max_seq_len=context)
    assert _rows_to_end(greedy, eos, pad)[0] == free[0, :5].tolist()
    assert greedy.shape[1] > 5 and greedy[0, 5] == pad  # another caption goes on: image 0's is padded
    with torch.no_grad():  # top_p of a tiny nucleus keeps the top token alone: greedy too
        nucleus = generate(coca.model, images, "top_p", sot, eos, pad, top_p=1e-6, seq_len=8, min_seq_len=3,
                           max_seq_len=context)
    assert _rows_to_end(nucleus, eos, pad) == _rows_to_end(greedy, eos, pad)
    with torch.no_grad():  # the start token is the caller's too
        other = generate(coca.model, images, "top_k", 100, eos, pad, top_k=1, seq_len=8, min_seq_len=3,
                         max_seq_len=context)
    assert (other[:, 0] == 100).all()


def test_an_unknown_generation_type_is_refused_naming_the_types():
    with pytest.raises(ValueError) as refused:
        generate(_Table(1, seed=0), torch.arange(1), "greedy", SOT, EOS, PAD)
    assert str(refused.value) == "generation type 'greedy' is not one of ['beam_search', 'top_p', 'top_k']"
