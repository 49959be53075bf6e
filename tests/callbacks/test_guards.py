import os
import tempfile
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from mmssl.callbacks.guards import EvaluationBufferSync, NonFiniteGuard


class _Poisoned(pl.LightningModule):
    """A linear model whose loss is NaN on the steps listed in ``bad_steps``."""

    def __init__(self, bad_steps: set[int], fused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.bad_steps = bad_steps
        self.fused = fused
        self.snapshots: dict[int, torch.Tensor] = {}
        self.optimizer_states: dict[int, list[dict[str, torch.Tensor]]] = {}

    def training_step(self, batch, batch_idx):
        self.snapshots[self.global_step] = self.layer.weight.detach().clone()
        optimizer = self.optimizers().optimizer
        self.optimizer_states[self.global_step] = [
            {k: v.clone() for k, v in optimizer.state[p].items()} for p in self.parameters()
        ]
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step in self.bad_steps:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1, weight_decay=0.1, fused=self.fused)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)))
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


def _same_state(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return [sorted(x) for x in a] == [sorted(x) for x in b] and all(
        torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x
    )


def test_fused_adamw_skips_on_the_device_and_reads_the_host_only_at_checks():
    """Fused AdamW takes the flag as its ``found_inf``: weights, moments and step counts untouched,
    the same trajectory as the synchronous path, and the host reads the counts only at checks."""
    model, guard = _Poisoned({0, 3, 4}, fused=True), NonFiniteGuard(max_consecutive=3, every_n_steps=4)
    trainer = _trainer(guard, 12)
    assert trainer.log_every_n_steps == 50  # so only every_n_steps decides the reads
    trainer.fit(model)
    s, o = model.snapshots, model.optimizer_states
    assert torch.equal(s[0], s[1]) and torch.equal(s[3], s[4]) and torch.equal(s[4], s[5])
    assert not torch.equal(s[1], s[2]) and not torch.equal(s[5], s[6])  # good steps still train
    assert _same_state(o[3], o[4]) and _same_state(o[4], o[5])  # moments and step counts unchanged
    assert all(state["step"].item() == 0 for state in o[1])  # the skipped first step took no count
    assert [state["step"].item() for state in o[6]] == [3.0, 3.0]  # 6 steps, 3 skipped
    # Reads at steps 4, 8, 12 and at the end of training: 4 over 12 steps, none in between.
    assert guard.host_reads == 4 and guard.skipped == 3 and guard.consecutive == 0
    assert not hasattr(model.optimizers().optimizer, "found_inf")  # disarmed after each step

    reference = _Poisoned({0, 3, 4}, fused=False)  # the synchronous path (grads dropped)
    sync_guard = NonFiniteGuard(max_consecutive=3, every_n_steps=4)
    _trainer(sync_guard, 12).fit(reference)
    assert sync_guard.skipped == 3
    torch.testing.assert_close(model.layer.weight, reference.layer.weight)


def test_fused_path_stops_at_the_first_check_after_too_many_in_a_row():
    model, guard = _Poisoned(set(range(1, 20)), fused=True), NonFiniteGuard(max_consecutive=2, every_n_steps=4)
    with pytest.raises(RuntimeError, match=r"NaN/inf for 3 steps in a row \(the limit is 2; step 3,"):
        _trainer(guard, 20).fit(model)
    assert all(torch.equal(model.snapshots[1], w) for step, w in model.snapshots.items() if step >= 1)
    assert guard.host_reads == 1 and guard.skipped == 3


def test_sync_free_is_picked_only_where_the_fused_step_takes_the_step_back():
    trainer = _trainer(NonFiniteGuard(), 1)
    w = [nn.Parameter(torch.zeros(2))]
    assert NonFiniteGuard.sync_free(trainer, torch.optim.AdamW(w, fused=True))
    assert NonFiniteGuard.sync_free(trainer, torch.optim.Adam(w, fused=True))
    assert not NonFiniteGuard.sync_free(trainer, torch.optim.AdamW(w))
    assert not NonFiniteGuard.sync_free(trainer, torch.optim.SGD(w, lr=0.1, momentum=0.9, fused=True))
    # fp16 mixed precision: the GradScaler steps the optimizer (and skips on inf) itself, so the
    # guard must not hand the fused step a second skip flag. Lightning's CPU trainer cannot build
    # a "16-mixed" plugin, hence the plugin's attribute is set by hand.
    fused = torch.optim.AdamW(w, fused=True)
    scaled = SimpleNamespace(precision_plugin=SimpleNamespace(scaler=torch.amp.GradScaler("cpu")))
    assert not NonFiniteGuard.sync_free(scaled, fused)
    assert NonFiniteGuard.sync_free(SimpleNamespace(precision_plugin=SimpleNamespace(scaler=None)), fused)


def test_evaluation_buffer_sync_turns_ddps_broadcast_off_for_validation_and_puts_the_flags_back():
    """A real DDP wrapper on a 1-rank gloo group in this process (the hang this prevents needs 2
    ranks: tests/test_ddp.py runs it with one validation shard; here each flag is checked on its own)."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already up")
    sync = EvaluationBufferSync()
    plain = SimpleNamespace(strategy=SimpleNamespace(model=nn.Linear(3, 3)))
    sync.on_validation_start(plain, None)  # no DDP wrapper (one device): nothing to do
    sync.on_validation_end(plain, None)
    with tempfile.TemporaryDirectory() as root:
        torch.distributed.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}",
                                             rank=0, world_size=1)
        try:
            ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
            trainer = SimpleNamespace(strategy=SimpleNamespace(model=ddp))
            ddp(torch.randn(4, 3)).sum().backward()  # a training step: the next forward would broadcast
            assert (ddp.broadcast_buffers, ddp.require_forward_param_sync) == (True, True)
            sync.on_validation_start(trainer, None)
            assert not ddp.will_sync_module_buffers()
            assert (ddp.broadcast_buffers, ddp.require_forward_param_sync) == (False, True)
            with torch.no_grad():
                ddp(torch.randn(4, 3))  # a validation forward rewrites the flag ...
            assert not ddp.require_forward_param_sync
            sync.on_validation_end(trainer, None)  # ... and it is put back as training left it
            assert (ddp.broadcast_buffers, ddp.require_forward_param_sync) == (True, True)
            ddp.broadcast_buffers = False
            sync.on_validation_end(trainer, None)  # a second end restores nothing stale
            assert (ddp.broadcast_buffers, ddp.require_forward_param_sync) == (False, True)
        finally:
            torch.distributed.destroy_process_group()


def test_a_checkpoint_between_checks_keeps_the_counts_exact_and_the_stop_pending():
    model, guard = _Poisoned({1, 2}, fused=True), NonFiniteGuard(max_consecutive=2, every_n_steps=6)

    class _SaveAt(pl.Callback):  # the state a checkpoint at step 4 would hold
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 4:
                self.saved = guard.state_dict()

    saver = _SaveAt()
    trainer = pl.Trainer(max_steps=10, callbacks=[guard, saver], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"NaN/inf for 2 steps in a row \(the limit is 2; step 5,"):
        trainer.fit(model)  # the run of steps 1-2 ended before the checkpoint; the read at step 6 stops
    assert saver.saved == {"skipped": 2, "consecutive": 0}


def test_a_restored_guard_counts_on_from_the_checkpoint():
    # The run of skipped steps a checkpoint recorded goes on after the resume (synchronous path).
    guard = NonFiniteGuard(max_consecutive=3)
    guard.load_state_dict({"skipped": 4, "consecutive": 2})
    assert guard.state_dict() == {"skipped": 4, "consecutive": 2}
    with pytest.raises(
        RuntimeError, match=r"NaN/inf for 3 steps in a row \(the limit is 3; step 0, 5 skipped in all\)"
    ) as stop:
        _trainer(guard, 4).fit(_Poisoned({0}))
    assert str(stop.value).endswith(". Lower the learning rate, raise warm-up, or check the data; the last good "
                                    "checkpoint is untouched.")


def test_a_limit_of_one_lets_a_clean_run_finish():
    # The end-of-training read finds no device counts on the synchronous path: nothing was skipped.
    guard = NonFiniteGuard(max_consecutive=1)
    _trainer(guard, 3).fit(_Poisoned(set()))
    assert guard.skipped == 0 and guard.consecutive == 0


def test_the_fused_path_stops_at_the_end_of_training_when_no_check_came_after_the_run():
    guard = NonFiniteGuard(max_consecutive=2, every_n_steps=100)
    with pytest.raises(
        RuntimeError, match=r"NaN/inf for 2 steps in a row \(the limit is 2; step 4, 2 skipped in all\)"
    ):
        _trainer(guard, 4).fit(_Poisoned({2, 3}, fused=True))


def test_the_fused_path_logs_the_skipped_count_at_its_checks():
    trainer = _trainer(NonFiniteGuard(max_consecutive=3, every_n_steps=2), 4)
    trainer.fit(_Poisoned({0, 2}, fused=True))
    assert trainer.callback_metrics["train/nonfinite_skipped"].item() == 2.0


def test_a_step_without_gradients_counts_as_finite_on_the_fused_path():
    # A rank whose batch reached no parameter still takes part (its flag is a zero on the device).
    model, guard = _Poisoned(set(), fused=True), NonFiniteGuard(every_n_steps=1)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    trainer = _trainer(guard, 1)
    guard.on_before_optimizer_step(trainer, model, optimizer)
    assert guard.host_reads == 1 and guard.skipped == 0 and guard.consecutive == 0


def test_the_limits_default_to_five_and_logging_steps_accept_one_and_refuse_zero():
    guard = NonFiniteGuard()
    assert (guard.max_consecutive, guard.every_n_steps) == (5, None)
    assert guard.state_dict() == {"skipped": 0, "consecutive": 0}
    NonFiniteGuard(max_consecutive=1, every_n_steps=1)
    with pytest.raises(ValueError, match=r"^--nonfinite_guard.max_consecutive must be >= 1, got 0$"):
        NonFiniteGuard(max_consecutive=0)
    with pytest.raises(ValueError, match=r"^--nonfinite_guard.every_n_steps must be >= 1 or null, got 0$"):
        NonFiniteGuard(every_n_steps=0)


def test_each_path_logs_the_skipped_count_by_default_on_logging_steps():
    for fused in (False, True):
        guard = NonFiniteGuard()
        trainer = pl.Trainer(max_steps=4, callbacks=[guard], logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2)
        trainer.fit(_Poisoned({0}, fused=fused))
        assert trainer.callback_metrics["train/nonfinite_skipped"].item() == 1.0, fused
        assert guard.host_reads == (3 if fused else 0)  # steps 2 and 4 log, and the end of training
