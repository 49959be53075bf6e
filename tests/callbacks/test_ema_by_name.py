"""The EMA pairs the average's tensors with the model's by name, not by position.

peft 0.22's LoRA on ``nn.MultiheadAttention`` re-registers the base layer's ``in_proj_weight`` at
every forward, which moves it to the end of its module's parameters: torch's ``AveragedModel`` and
Lightning's ``WeightAveraging`` pair the two models' tensors by position, so the next update copied
a (96, 32) weight into a (96,) bias and the run stopped (CI's fresh venv:
tests/callbacks/test_ema.py::test_a_lora_run_with_an_ema_resumes_with_its_average). Here a module
that re-registers a parameter the same way stands in for peft, so the test does not depend on its
version.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from mmssl.callbacks import EMA
from mmssl.callbacks.ema import _AveragedByName
from mmssl.upstream import set_averaged_module, set_weight_averaging_model


class Reregisters(nn.Module):
    """Two parameters of different shapes and a buffer; each forward re-registers ``weight``, as
    peft's LoRA on multi-head attention does with ``in_proj_weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 2))
        self.bias = nn.Parameter(torch.zeros(3))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters.pop("weight")
        self.weight = weight  # registered again: now after ``bias``
        return x @ weight.T + self.bias


def _moved() -> tuple[Reregisters, Reregisters]:
    model = Reregisters()
    average = deepcopy(model)  # built before the first forward, as the EMA's copy is
    model(torch.ones(1, 2))
    assert [n for n, _ in model.named_parameters()] == ["bias", "weight"]
    assert [n for n, _ in average.named_parameters()] == ["weight", "bias"]
    return model, average


def test_the_average_follows_each_tensor_by_name_after_the_model_reordered_its_parameters():
    model, copy = _moved()
    average = _AveragedByName(nn.Identity(), use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    set_averaged_module(average, copy)
    with torch.no_grad():
        model.weight.fill_(2.0), model.bias.fill_(4.0), model.count.fill_(6.0)
    average.update_parameters(model)  # the first update copies
    with torch.no_grad():
        model.weight.fill_(0.0), model.bias.fill_(0.0), model.count.fill_(0.0)
    average.update_parameters(model)  # then 0.5 * average + 0.5 * model
    assert torch.equal(average.module.weight, torch.full((3, 2), 1.0))
    assert torch.equal(average.module.bias, torch.full((3,), 2.0))
    assert torch.equal(average.module.count, torch.tensor(3.0))
    assert int(average.n_averaged) == 2

    plain = AveragedModel(nn.Identity(), use_buffers=True)  # torch's own, by position: what failed
    set_averaged_module(plain, _moved()[1])
    with pytest.raises(RuntimeError, match="must match the size"):
        plain.update_parameters(_moved()[0])


def test_the_swap_and_the_final_copy_pair_tensors_by_name():
    model, copy = _moved()
    average = _AveragedByName(nn.Identity(), use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    set_averaged_module(average, copy)
    with torch.no_grad():
        average.module.weight.fill_(1.0), average.module.bias.fill_(3.0)
        model.weight.fill_(5.0), model.bias.fill_(7.0)
    ema = EMA()
    set_weight_averaging_model(ema, average)
    ema._swap_models(model)  # validation on the average (WeightAveraging's hook calls it)
    assert torch.equal(model.weight, torch.full((3, 2), 1.0)) and torch.equal(model.bias, torch.full((3,), 3.0))
    assert torch.equal(average.module.weight, torch.full((3, 2), 5.0))
    ema._swap_models(model)
    ema._copy_average_to_current(model)  # the end of fit with evaluate="ema"
    assert torch.equal(model.weight, torch.full((3, 2), 1.0)) and torch.equal(model.bias, torch.full((3,), 3.0))


def test_a_tensor_the_model_lacks_is_named():
    model, copy = _moved()
    copy.register_buffer("extra", torch.zeros(1))
    average = _AveragedByName(nn.Identity(), use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    set_averaged_module(average, copy)
    with pytest.raises(ValueError, match="no tensor 'extra'"):
        average.update_parameters(model)
