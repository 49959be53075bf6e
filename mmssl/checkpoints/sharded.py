"""FSDP2 runs: Lightning's ``ModelParallelStrategy`` with checkpoint folders nothing can lose.

Lightning's strategy writes a sharded checkpoint (a torch.distributed.checkpoint folder: one
``__R_0.distcp`` per rank, ``.metadata``, Lightning's ``meta.pt``) **into** the target folder, over
the previous checkpoint's files: a kill or a full disk mid-write leaves a folder that is neither.
It loads ``meta.pt`` with ``weights_only=False`` and DCP unpickles ``.metadata`` freely. Here:

- a checkpoint folder is written beside the target under a hidden name, completed (DCP writes
  ``.metadata`` once every rank's shard is written; ``meta.pt`` follows, fsynced) and only then
  renamed over the target, so ``last.ckpt`` is at every moment the previous complete folder or
  the new one. The previous folder is set aside under a hidden ``.old`` name for the instant
  between the two renames (:func:`mmssl.checkpoints.resume.run_checkpoints` lists it, so a kill
  there still resumes) and removed after;
- a folder is read through :func:`mmssl.checkpoints.read.load_dcp` (metadata types only,
  ``weights_only=True`` for every entry, every shard checked) and ``meta.pt`` through the one
  reader; a file checkpoint (a DDP run's) through the one reader too, then Lightning's own
  loading (which broadcasts and shards it): resume across strategies either way;
- ``async_mode="async"``: the same folder written in the background, the step blocked only while
  the state is copied (:mod:`mmssl.checkpoints.async_save`).
"""

from __future__ import annotations

import copy
import glob
import os
import secrets
import shutil
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy

from mmssl.checkpoints.async_save import ASYNC_MODES, AsyncSaves, CheckpointWriteError, on_every_rank
from mmssl.checkpoints.io import (
    OLD,
    PARTIAL,
    AtomicCheckpointIO,
    atomic_torch_save,
    hidden_name,
    remove_path,
    replace_path,
    set_aside_paths,
    writer_alive,
)
from mmssl.checkpoints.read import (
    AVERAGED_WEIGHTS,
    AVERAGING_STATE,
    LIGHTNING_META,
    RAW_WEIGHTS,
    SAVE_ID,
    check_save_id,
    has_averaged_weights,
    is_dcp_folder,
    load_dcp,
    read_checkpoint,
    read_dcp_metadata,
)
from mmssl.sharding import DTYPES, ShardingPolicy, check_sharded
from mmssl.upstream import fsdp2_forget_forward_order, fsdp2_lazy_init

# AVERAGED_WEIGHTS (mmssl.checkpoints.read): the folder entry of an EMA's average, sharded as the
# parameters; the folder's ``state_dict`` holds the raw weights.
set_aside_folders = set_aside_paths  # complete checkpoints a kill between two renames left beside a target


def remove_stale_partials(path: Path, keep: Optional[Path] = None) -> list[Path]:
    """Remove the half-written :data:`PARTIAL` folders of ``path`` that no live writer owns (a save
    killed mid-write leaves a checkpoint's worth of shards there): those of dead processes of this
    host (:func:`mmssl.checkpoints.io.writer_alive`), never ``keep`` (the save in progress).

    Returns:
        The folders removed.
    """
    pattern = os.path.join(glob.escape(str(path.parent)), f".{glob.escape(path.name)}.*{PARTIAL}")
    removed = []
    for found in map(Path, glob.glob(pattern)):
        if found != keep and not writer_alive(found):
            remove_path(found)
            removed.append(found)
    return removed


def gather_module(module: torch.nn.Module) -> None:
    """All-gather every FSDP2 unit of ``module`` and keep it gathered until :func:`reshard_module`:
    its forwards then run without collectives (an evaluation with uneven shares per rank). Every
    rank calls it."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        fsdp2_lazy_init(module)  # the root, before evaluation code enters an inner block first
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()


def reshard_module(module: torch.nn.Module, reshard_after_forward: bool) -> None:
    """Free what :func:`gather_module` gathered; each unit but the root reshards after its forward
    again when ``reshard_after_forward`` (the root keeps its parameters from forward to backward).
    The evaluation's forwards, which ranks ran in different numbers, are forgotten
    (:func:`mmssl.upstream.fsdp2_forget_forward_order`). Every rank calls it."""
    from torch.distributed.fsdp import FSDPModule

    fsdp2_forget_forward_order(module)
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
            if unit is not module:
                unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, data-parallel) with mmssl's sharding keys and safe checkpoints.

    Args:
        data_parallel_size: ranks the parameters are sharded across (``auto``: all of them).
        save_distributed_checkpoint: ``True``: a DCP folder per checkpoint, each rank writing its
            shard (no rank ever holds the whole state); ``False``: one full-state file gathered on rank 0.
        param_dtype, reduce_dtype, reshard_after_forward: :class:`mmssl.sharding.ShardingPolicy`.
        gather_for_evaluation: gather the whole model once per validation / test / predict run, so
            that ranks with uneven held-out shares run their forwards without collectives;
            ``False``: evaluate sharded, and refuse uneven validation shares at start-up.
        async_mode: ``"async"``: a sharded save blocks the step only while the state is copied;
            the folder is written in the background and renamed into place once complete
            (:mod:`mmssl.checkpoints.async_save`); ``"disabled"`` (default): written before the
            step goes on. torchtitan's key and values.
        process_group_backend, timeout: as for Lightning's strategy (``gloo`` on CPUs).
    """

    def __init__(self, data_parallel_size: Union[Literal["auto"], int] = "auto",
                 save_distributed_checkpoint: bool = True, param_dtype: Optional[str] = None,
                 reduce_dtype: Optional[str] = None, reshard_after_forward: bool = True,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 tensor_parallel_size: Union[Literal["auto"], int] = 1, gather_for_evaluation: bool = True,
                 async_mode: Literal["disabled", "async"] = "disabled") -> None:
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=tensor_parallel_size,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.sharded_checkpoints = save_distributed_checkpoint
        self.policy = ShardingPolicy(param_dtype, reduce_dtype, reshard_after_forward)
        self.gather_for_evaluation = gather_for_evaluation
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode={async_mode!r}: one of {', '.join(ASYNC_MODES)}")
        if async_mode == "async" and not save_distributed_checkpoint:
            raise ValueError("async_mode='async' writes sharded checkpoint folders in the background: it needs "
                             "save_distributed_checkpoint: true")
        self.async_mode = async_mode
        self._async = AsyncSaves(timeout) if async_mode == "async" else None
        self._autocast: Optional[torch.autocast] = None  # open while a mixed-precision run evaluates

    # Evaluation: under FSDP2 every forward all-gathers each block, a collective, and held-out
    # shards are dealt per rank, so ranks run different numbers of forwards (the demo's one
    # validation shard gives rank 1 none), which would hang. Each evaluation therefore starts with
    # one all-gather of the whole model on every rank and runs its forwards without collectives
    # (FSDP2 skips the all-gather of a gathered unit); the shards are freed when it ends. The cost:
    # the whole model's parameters on each rank while evaluating (not its gradients or optimizer
    # state); ``gather_for_evaluation: false`` keeps them sharded and asks for even shares.

    def _gather(self) -> None:
        if self.policy.param_dtype is not None and self._autocast is None:
            # Gathered parameters are in param_dtype, and evaluation code calls named stages
            # (encode_image, forward_features) that FSDP2's input casting, on forward only, never
            # sees: autocast gives their fp32 inputs the parameters' dtype.
            self._autocast = torch.autocast(self.root_device.type, dtype=DTYPES[self.policy.param_dtype])
            self._autocast.__enter__()
        if self.gather_for_evaluation and self.model is not None:
            gather_module(self.model)

    def _reshard(self) -> None:
        if self._autocast is not None:
            self._autocast.__exit__(None, None, None)
            self._autocast = None
        if self.gather_for_evaluation and self.model is not None:
            reshard_module(self.model, self.policy.reshard_after_forward)
        elif self.model is not None:  # sharded evaluation: its forwards are not training's either
            fsdp2_forget_forward_order(self.model)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._gather()

    def on_validation_end(self) -> None:
        self._reshard()
        super().on_validation_end()

    def on_test_start(self) -> None:
        super().on_test_start()
        self._gather()

    def on_test_end(self) -> None:
        self._reshard()
        super().on_test_end()

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self._gather()

    def on_predict_end(self) -> None:
        self._reshard()
        super().on_predict_end()

    def setup_environment(self) -> None:
        # Lightning's "auto" data-parallel size is the number of nodes (its tensor-parallel size
        # then fills each node); mmssl shards data-parallel only, so "auto" is every rank, on
        # however many processes a run (or a resume) starts.
        if self._data_parallel_size == "auto" and isinstance(self._tensor_parallel_size, int):
            self._data_parallel_size = max(1, self.num_nodes * self.num_processes // self._tensor_parallel_size)
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        check_sharded(self.lightning_module, trainer)  # configure_model has run: refuse a silent replica
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to the folder ``filepath`` (or the file, without sharded checkpoints),
        replacing what is there only once the new one is complete. Every rank calls it."""
        if not self.sharded_checkpoints:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        import torch.distributed.checkpoint as dcp

        if self._async is not None:
            self._async.wait()  # one write in flight; the previous one's failure is raised here
        path = Path(self.broadcast(str(filepath))).absolute()
        temp = Path(self.broadcast(str(hidden_name(path, PARTIAL))))
        state = {"state_dict": checkpoint.pop("state_dict")}
        if isinstance(checkpoint.get(RAW_WEIGHTS), dict):
            # An EMA's checkpoint (WeightAveraging's layout: the average in ``state_dict``). In the
            # folder ``state_dict`` is the raw weights, which every resume trains on (with or without
            # the EMA callback), and the average its own entry, each sharded as the parameters.
            state = {"state_dict": checkpoint.pop(RAW_WEIGHTS), AVERAGED_WEIGHTS: state["state_dict"]}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        # The save's identity, drawn on rank 0 and agreed by broadcast: each rank writes it into its
        # own shard and meta.pt records it, so a shard of another save is refused on read.
        save_id = int(self.broadcast(secrets.randbits(62)))
        state[SAVE_ID] = {f"rank{self.global_rank}": torch.tensor([save_id], dtype=torch.int64)}
        checkpoint[SAVE_ID] = save_id
        on_every_rank(lambda: temp.mkdir(parents=True), f"create {temp.name}", temp, path)
        if self._async is not None:
            meta = copy.deepcopy(checkpoint)  # the loops' and callbacks' state as of this step
            self._async.start(state, temp, path, lambda: self._complete(meta, temp, path))
            if path.name.startswith(HPC_CHECKPOINT):
                self._async.wait()  # Lightning's SLURM handler requeues the job right after this save
            return
        try:
            dcp.save(state, checkpoint_id=temp)  # .metadata written last, by the coordinator
        except BaseException:
            if self.global_rank == 0:
                shutil.rmtree(temp, ignore_errors=True)
            raise
        on_every_rank(lambda: self._complete(checkpoint, temp, path), f"write {LIGHTNING_META} or rename the folder",
                      temp, path)

    def _complete(self, checkpoint: dict[str, Any], temp: Path, path: Path) -> None:
        """Rank 0: ``meta.pt``, every file synced, then the folder renamed to ``path``."""
        atomic_torch_save(checkpoint, str(temp / LIGHTNING_META))
        for name in os.listdir(temp):  # the shards are on disk before the folder is named
            with open(temp / name, "rb+") as f:
                os.fsync(f.fileno())
        self._replace(temp, path)

    @staticmethod
    def _replace(temp: Path, path: Path) -> None:
        """Rename the complete folder ``temp`` to ``path`` (a folder or a file there set aside first,
        :func:`mmssl.checkpoints.io.replace_path`), then remove what killed saves left beside it."""
        replace_path(temp, path)
        remove_stale_partials(path)

    # The background write (async_mode "async"): its failure raised at the next step on every
    # rank, and waited for at the end of training and at teardown (a failure, an interrupt).

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self._async is not None:
            self._async.raise_if_failed(self.root_device)

    def on_train_end(self) -> None:
        if self._async is not None:
            self._async.wait()  # the last checkpoint is in place when fit returns
        super().on_train_end()

    def teardown(self) -> None:
        if self._async is not None:
            try:
                self._async.close()
            except Exception as err:  # raised on a failure's way out: said, not raised over it
                warnings.warn(str(err), stacklevel=1)
        super().teardown()

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's top-k clean-up: a folder checkpoint is removed whole (rank 0); with a write
        in flight, once that write is in place (the previous best stays until the new one is)."""
        if self._async is None:
            self._remove_now(filepath)
        elif self._async.pending_path == Path(filepath).absolute():
            self._async.wait()  # every rank removes the same path: not under a write in flight
            self._remove_now(filepath)
        else:
            self._async.after_write(lambda: self._remove_now(filepath))

    def _remove_now(self, filepath: Any) -> None:
        if self.is_global_zero and os.path.isdir(filepath):
            shutil.rmtree(filepath, ignore_errors=True)
        else:
            super().remove_checkpoint(filepath)

    # Restored before setup, as under DDP: configure_model has sharded the model by then, and the
    # data module, callbacks and loops get their state before the setup builds the optimizers (whose
    # schedules ask for the step count, which opens the training loader: at the saved position).
    # Lightning's strategy restores after its setup, which opened that loader at the epoch's start.

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return False

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load the weights into the sharded model; return the rest of the checkpoint (loops,
        callbacks, schedulers, data position; optimizer states follow in
        :meth:`load_optimizer_state_dict`), all read as plain data. A folder is read shard by
        shard (DCP reshards to this run's ranks), a file (a DDP run's) whole and scattered."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        path = str(self.broadcast(str(checkpoint_path)))
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        if not is_dcp_folder(path):
            checkpoint = raw_first(read_checkpoint(path), path)
            state = _shaped(checkpoint.pop("state_dict"), dict(self.model.named_parameters()))
            set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=strict))
            return checkpoint
        read_dcp_metadata(path)  # a named error for a torn or crafted folder, before any state moves
        check_save_id(path)  # every shard of the save meta.pt records
        meta = raw_first(read_checkpoint(os.path.join(path, LIGHTNING_META)), path)
        model_state = {"state_dict": get_model_state_dict(self.model)}
        load_dcp(path, model_state)
        self.model.load_state_dict(model_state["state_dict"], strict=strict)
        meta["optimizer_states"] = [_FROM_FOLDER]  # Lightning asks for the key; the states are read below
        meta[_FOLDER] = path
        return meta

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's state from the folder (resharded), or from a file's full state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        assert self.model is not None
        params = dict(self.model.named_parameters())
        for i, optimizer in enumerate(self.optimizers):
            if _FOLDER in checkpoint:
                key = f"optimizer_{i}"
                state = {key: get_optimizer_state_dict(self.model, optimizer)}
                load_dcp(checkpoint[_FOLDER], state)
                set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state[key],
                                         options=StateDictOptions(cpu_offload=True))
            else:
                named = _named_optimizer_state(checkpoint["optimizer_states"][i], optimizer, params)
                set_optimizer_state_dict(self.model, optimizer, optim_state_dict=named,
                                         options=StateDictOptions(full_state_dict=True))


_FOLDER, _FROM_FOLDER = "sharded_checkpoint_folder", "in the sharded checkpoint folder"
HPC_CHECKPOINT = "hpc_ckpt_"  # Lightning's preemption saves (hpc_ckpt_N.ckpt), always waited for


def _shaped(state: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``state`` with each tensor in its parameter's shape where only the shape differs (CLIP's
    0-d ``logit_scale`` of a DDP checkpoint, (1,) in a sharded model)."""
    out = {}
    for name, value in state.items():
        param = params.get(name)
        if param is not None and isinstance(value, torch.Tensor) and value.shape != param.shape \
                and value.numel() == param.numel():
            value = value.reshape(param.shape)
        out[name] = value
    return out


def _named_optimizer_state(state: dict[str, Any], optimizer: Any, params: dict[str, Any]) -> dict[str, Any]:
    """A ``torch.optim.Optimizer.state_dict()`` (parameters numbered in the groups' order, as a DDP
    run saves it) keyed by parameter names, as ``set_optimizer_state_dict`` takes a full state."""
    name_of = {id(p): n for n, p in params.items()}
    names = [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    entries = {}
    for index, entry in state["state"].items():
        name = names[index]
        entries[name] = {k: (v.reshape(params[name].shape) if isinstance(v, torch.Tensor) and k != "step"
                             and v.numel() == params[name].numel() else v) for k, v in entry.items()}
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    return {"state": entries, "param_groups": groups}


class SafeCheckpointIO(AtomicCheckpointIO):
    """:class:`AtomicCheckpointIO` whose loads go through the one reader: a file as plain data
    (``weights_only=True``), a sharded folder consolidated (an FSDP2 run resumed under DDP or on
    one device). ``mmssl fit`` installs it unless the config names its own ``CheckpointIO``."""

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        return raw_first(read_checkpoint(str(path)), str(path))


def raw_first(checkpoint: dict[str, Any], path: str) -> dict[str, Any]:
    """A checkpoint with an EMA of the weights (:mod:`mmssl.callbacks.ema`) laid out for a resume:
    ``state_dict`` the raw weights, which the model is loaded with and training continues from,
    and the average under :data:`AVERAGED_WEIGHTS` (a folder's stays in the folder), which only
    ``mmssl.callbacks.EMA`` restores. Says so once (rank 0): without the callback the average is
    dropped, where Lightning's own loading took the average with the raw weights' optimizer state.

    Args:
        checkpoint: as read (a file in ``WeightAveraging``'s layout: the average in ``state_dict``,
            the raw weights in ``current_model_state``; or a folder's ``meta.pt``).
        path: the checkpoint, named in the warning.

    Returns:
        ``checkpoint``, changed in place.
    """
    from lightning.pytorch.utilities import rank_zero_warn

    if has_averaged_weights(checkpoint):
        checkpoint[AVERAGED_WEIGHTS] = checkpoint["state_dict"]
        checkpoint["state_dict"] = checkpoint.pop(RAW_WEIGHTS)
    elif AVERAGING_STATE not in checkpoint:
        return checkpoint
    rank_zero_warn(f"{path} holds the raw weights and an EMA of them: the model is loaded with the raw weights "
                   f"('{RAW_WEIGHTS}' of a file, 'state_dict' of a folder), which training continues from; the "
                   "EMA is restored by mmssl.callbacks.EMA when trainer.callbacks has it, and is unused otherwise")
    return checkpoint


def checkpoint_folder(checkpoint: Mapping[str, Any]) -> Optional[str]:
    """The sharded checkpoint folder :meth:`FSDP2Strategy.load_checkpoint` read ``checkpoint`` from
    (its tensors stay there until loaded into sharded modules), or ``None`` for a file's."""
    return checkpoint.get(_FOLDER)


def load_averaged_weights(folder: str, module: torch.nn.Module) -> dict[str, Any]:
    """Load the :data:`AVERAGED_WEIGHTS` of the checkpoint folder ``folder`` into the FSDP2-sharded
    ``module`` (each rank reads its shards; DCP reshards to this run's number of ranks). Every
    rank calls it.

    Returns:
        The state loaded (the module's own tensors), for a caller that checks its keys.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {AVERAGED_WEIGHTS: get_model_state_dict(module)}
    load_dcp(folder, state)
    return state[AVERAGED_WEIGHTS]


def load_full_state(module: torch.nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Scatter a whole-tensor state dict (a file checkpoint's) into the FSDP2-sharded ``module``
    (each rank keeps its shards; 0-d scalars of a DDP file fit the sharded (1,) ones). Every rank
    calls it, each with the whole state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = _shaped(state, dict(module.named_parameters()))
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a checkpoint folder (an FSDP2 run's) rather than a file."""
    return is_dcp_folder(path)


__all__ = ["AVERAGED_WEIGHTS", "OLD", "PARTIAL", "SAVE_ID", "CheckpointWriteError", "FSDP2Strategy",
           "SafeCheckpointIO", "check_save_id", "checkpoint_folder", "gather_module", "hidden_name",
           "is_sharded_checkpoint", "load_averaged_weights", "load_full_state", "raw_first", "remove_stale_partials",
           "reshard_module", "set_aside_folders"]
