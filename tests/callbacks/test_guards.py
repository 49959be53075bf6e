import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from mmssl.callbacks.guards import NonFiniteGuard


class _Poisoned(pl.LightningModule):
    """A linear model whose loss is NaN on the steps listed in ``bad_steps``."""

    def __init__(self, bad_steps: set[int]):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.bad_steps = bad_steps
        self.snapshots: dict[int, torch.Tensor] = {}

    def training_step(self, batch, batch_idx):
        self.snapshots[self.global_step] = self.layer.weight.detach().clone()
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step in self.bad_steps:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


def _trainer(guard: NonFiniteGuard, steps: int) -> pl.Trainer:
    return pl.Trainer(max_steps=steps, callbacks=[guard], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def test_non_finite_steps_are_skipped_counted_and_leave_weights_untouched():
    model, guard = _Poisoned({2, 3}), NonFiniteGuard(max_consecutive=3)
    _trainer(guard, 6).fit(model)
    s = model.snapshots
    assert torch.equal(s[2], s[3]) and torch.equal(s[3], s[4])  # steps 2 and 3 changed nothing
    assert not torch.equal(s[1], s[2]) and not torch.equal(s[4], s[5])  # good steps still train
    assert torch.isfinite(model.layer.weight).all()
    assert guard.skipped == 2 and guard.consecutive == 0


def test_too_many_consecutive_non_finite_steps_stop_with_a_clear_error():
    guard = NonFiniteGuard(max_consecutive=2)
    with pytest.raises(RuntimeError, match="NaN/inf for 2 steps in a row"):
        _trainer(guard, 10).fit(_Poisoned({1, 2, 3}))
