"""The one place mmssl reads checkpoint files: tensors and plain data, never code.

``torch.load`` unpickles, and a pickle may name any importable callable (``os.system``,
``builtins.exec``) to be called while loading. Every file mmssl reads therefore goes through
:func:`read_checkpoint`: ``.safetensors`` via safetensors (no pickle at all), anything else via
``torch.load(weights_only=True)``, whose unpickler rebuilds only tensors, containers and
primitives, plus the types in :data:`SAFE_GLOBALS`. A file naming anything else is refused with
:class:`UnsafeCheckpointError` before any of it runs. Which module class to build from a Lightning
checkpoint is chosen from the table of model kinds (``mmssl.checkpoints.layouts.KINDS``), never
imported from a name the file holds.
"""

from __future__ import annotations

import os
import pickle
import pickletools
import warnings
import zipfile
from typing import Any, Callable

import torch

from mmssl.checkpoints.layouts import strip_ddp
from mmssl.errors import CheckpointError

# Types besides torch's own weights_only set that a checkpoint may pickle and mmssl accepts.
# Measured with torch.serialization.get_unsafe_globals_in_checkpoint on checkpoints written by
# `mmssl fit` (configs/demo/{mae,clip}.yaml, ModelCheckpoint and LearningRateMonitor plus the
# always-on callbacks; Lightning 2.6, and the CLIP one under 2.2.0 too): none is needed.
# Hyper-parameters are saved as a plain dict without the optimizer callable
# (save_hyperparameters(ignore=["optimizer"])), and RNGState stores lists rather than numpy
# arrays. Keep it empty unless a checkpoint of ours needs a type, and then add only that
# pure-data type (never a callable).
SAFE_GLOBALS: tuple[Any, ...] = ()


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file pickles an object outside the allow-list; nothing of it was run."""


def _pickled_globals(path: str) -> list[str]:
    """``module.name`` of every global the pickles at the start of a legacy (non-zip) file
    refer to, read from the opcodes (``pickletools``), never executed."""
    found: list[str] = []
    with open(path, "rb") as f:
        for _ in range(4):  # torch's legacy format: magic, protocol, sys info, then the object
            strings: list[str] = []
            try:
                for opcode, arg, _pos in pickletools.genops(f):
                    if opcode.name == "GLOBAL":
                        found.append(str(arg).replace(" ", "."))
                    elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                        found.append(".".join(strings[-2:]))
                    elif isinstance(arg, str):
                        strings.append(arg)
            except Exception:  # the raw tensor bytes after the pickles, or the end of the file
                break
    return found


def _offending_globals(path: str) -> list[str]:
    """The globals of ``path`` outside torch's weights-only set and :data:`SAFE_GLOBALS`."""
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip checkpoint: a bare pickle or torch's legacy format
        found = [
            name for name in _pickled_globals(path)
            if not name.startswith("torch.") and name != "collections.OrderedDict"
        ]
    return sorted({name for name in found if name not in allowed})


# Sharded checkpoints: a torch.distributed.checkpoint (DCP) folder, as FSDP2 runs write them
# (mmssl.checkpoints.sharded). DCP's own reader unpickles ``.metadata`` with a plain
# ``pickle.load`` and the non-tensor entries of the shards (optimizer hyper-parameters) with
# ``torch.load(weights_only=False)``: a crafted folder would run code. Here ``.metadata`` is read
# by an unpickler that rebuilds only DCP's metadata types, and the shards' entries with
# ``weights_only=True``; ``meta.pt`` (Lightning's non-tensor state) through read_checkpoint.
DCP_METADATA, LIGHTNING_META = ".metadata", "meta.pt"
# Entry of a checkpoint naming the weights that are 0-d in the model and saved (1,) by a sharded run.
SCALAR_KEYS = "scalar_keys"
SAVE_ID = "save_id"  # meta.pt's key, and the folder entry each rank of a sharded save writes into its shard
_DCP_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Rebuilds DCP's metadata dataclasses, torch sizes and dtypes; refuses any other global."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_GLOBALS.get(module, ()) or (
                module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{module}.{name}")


def checkpoint_exists(path: str) -> bool:
    """Whether ``path`` is a checkpoint file or a sharded checkpoint folder (an FSDP2 run's)."""
    return os.path.isfile(path) or is_dcp_folder(path)


def is_dcp_folder(path: str) -> bool:
    """Whether ``path`` is a folder that claims to be a DCP checkpoint (it has ``.metadata``)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, DCP_METADATA))


def read_dcp_metadata(path: str) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of the DCP folder ``path``,
    checked: every shard file it names exists and holds the bytes it points to.

    Raises:
        FileNotFoundError: no ``.metadata`` (a folder DCP never finished), or a missing shard.
        UnsafeCheckpointError: ``.metadata`` pickles anything but DCP's metadata types.
        ValueError: ``.metadata`` is unreadable, or a shard is shorter than its entries.
    """
    file = os.path.join(path, DCP_METADATA)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {DCP_METADATA}: not a complete sharded checkpoint "
                                "(torch.distributed.checkpoint writes it last)")
    try:
        with open(file, "rb") as f:
            metadata = _DCPMetadataUnpickler(f).load()
    except UnsafeCheckpointError as err:
        raise UnsafeCheckpointError(f"{file}: refused to load: it pickles {err}, which a DCP metadata file "
                                    "never holds (nothing of it was run)") from None
    except Exception as err:
        raise CheckpointError(f"{file}: unreadable DCP metadata ({type(err).__name__}: {err})") from None
    ends: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"{path}: shard {name} named in {DCP_METADATA} is missing")
        if os.path.getsize(shard) < end:
            raise CheckpointError(f"{shard}: {os.path.getsize(shard)} bytes, but {DCP_METADATA} places entries up to "
                                  f"byte {end}: a truncated shard, or one from another checkpoint")
    return metadata


def _safe_dcp_classes() -> tuple[type, type]:
    """DCP's file reader and load planner, with :class:`_DCPMetadataUnpickler` and
    ``weights_only=True`` in place of their unrestricted unpickling."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(str(self.path))
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                self.original_state_dict_set(read_item, obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

        def original_state_dict_set(self, read_item: Any, obj: Any) -> None:
            _set_path(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)

    return SafeReader, SafePlanner


def _set_path(tree: Any, path: tuple, value: Any) -> None:
    """``tree[path[0]][path[1]]... = value``, creating dicts (lists for int keys) on the way."""
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(tree, list):
            while len(tree) <= key:
                tree.append(None)
            if tree[key] is None:
                tree[key] = [] if isinstance(nxt, int) else {}
            tree = tree[key]
        else:
            tree = tree.setdefault(key, [] if isinstance(nxt, int) else {})
    if isinstance(tree, list):
        while len(tree) <= path[-1]:
            tree.append(None)
    tree[path[-1]] = value


def _refusing_unsafe_entries(path: str, load: Callable[[], Any]) -> None:
    """``load()`` of a DCP folder; an entry the weights-only unpickler refused raises
    :class:`UnsafeCheckpointError` naming the folder, where DCP raises its ``CheckpointException``
    (a ``BaseException``, past every ``except Exception``) with each rank's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load()
    except CheckpointException as err:
        refused = [str(exc) for exc, _ in err.failures.values() if isinstance(exc, pickle.UnpicklingError)]
        if not refused:
            raise
        # torch's text: the line naming the global ("Trying to load unsupported GLOBAL posix.system ..."),
        # not its advice to load with weights_only=False.
        what = next((line.strip() for line in refused[0].splitlines() if "GLOBAL" in line), "content torch's "
                    "weights-only unpickler does not accept")
        raise UnsafeCheckpointError(f"{path}: refused to load: an entry of the folder pickles what mmssl does not "
                                    f"allow ({what}); nothing of it was run") from None


def load_dcp(path: str, state: dict[str, Any], process_group: Any = None) -> None:
    """``torch.distributed.checkpoint.load(state, path)`` in place, read as plain data
    (:func:`read_dcp_metadata`'s checks first). Under a process group every rank calls it.

    Raises:
        UnsafeCheckpointError: an entry pickles a global outside the allow-list (nothing of it ran).
    """
    import torch.distributed.checkpoint as dcp

    reader, planner = _safe_dcp_classes()
    _refusing_unsafe_entries(path, lambda: dcp.load(state, storage_reader=reader(path), planner=planner(),
                                                    process_group=process_group))


def check_save_id(path: str) -> None:
    """Refuse a checkpoint folder whose shards are not all of the save its ``meta.pt`` records (a
    shard copied from another run of the same size reads without error, mixing two runs' weights).
    A folder saved before save ids were recorded passes. No collective: each caller reads the ids
    (one number per rank) itself.

    Raises:
        ValueError: naming the folder and the first shard of another save.
    """
    import torch.distributed.checkpoint as dcp

    metadata = read_dcp_metadata(path)
    meta_file = os.path.join(path, LIGHTNING_META)
    recorded = read_checkpoint(meta_file).get(SAVE_ID) if os.path.isfile(meta_file) else None
    keys = sorted(k for k in metadata.state_dict_metadata if k.startswith(f"{SAVE_ID}."))
    if not keys or not isinstance(recorded, int):
        return
    state = {SAVE_ID: {k.split(".", 1)[1]: torch.zeros(1, dtype=torch.int64) for k in keys}}
    reader, planner = _safe_dcp_classes()
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        _refusing_unsafe_entries(path, lambda: dcp.load(state, storage_reader=reader(path), planner=planner(),
                                                        no_dist=True))
    shard_of = {index.fqn: info.relative_path for index, info in metadata.storage_data.items()}
    for key in keys:
        if int(state[SAVE_ID][key.split(".", 1)[1]].item()) != recorded:
            raise CheckpointError(f"{path}: shard {shard_of.get(key, key)} is not of this checkpoint's save (its "
                                  f"save id differs from {LIGHTNING_META}'s): a shard copied from another checkpoint")


def read_dcp_folder(path: str) -> dict[str, Any]:
    """A DCP checkpoint folder as one Lightning checkpoint dict, in this process (no process group).

    Returns:
        ``meta.pt``'s entries (``global_step``, ``hyper_parameters``, ...), ``state_dict`` with
        whole tensors, and ``optimizer_states`` as ``torch.optim.Optimizer.state_dict()`` lays
        them out (parameters numbered in the order of the groups' names), as a DDP run saves.

    Raises:
        FileNotFoundError: a folder without ``meta.pt`` (every sharded save writes it): weights
            alone would build a default model (``mmssl export``, ``load_model``, the evaluation
            loader) or a checkpoint without its step (``mmssl consolidate``). One line naming both.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(path)
    check_save_id(path)
    meta_file = os.path.join(path, LIGHTNING_META)
    checkpoint = read_checkpoint(meta_file) if os.path.isfile(meta_file) else {}  # refused below, once read
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = "<bytes_io>"  # a placeholder DCP fills, as its own empty-state planner does
    reader, planner_class = _safe_dcp_classes()
    planner = planner_class(flatten_state_dict=False)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        _refusing_unsafe_entries(path, lambda: dcp.load(flat, storage_reader=reader(path), planner=planner,
                                                        no_dist=True))
    flat = {**flat, **planner.state_dict}  # the planner's copy holds the non-tensor entries
    nested: dict[str, Any] = {}
    mappings = metadata.planner_data or {key: (key,) for key in flat}
    for key, value in flat.items():
        _set_path(nested, tuple(mappings.get(key, (key,))), value)
    if "state_dict" not in nested:  # another program's dcp.save: no weights to read (an empty model would load)
        raise CheckpointError(f"{path}: a sharded checkpoint folder without a state_dict entry (it holds "
                              f"{sorted(nested)[:8]}): not a Lightning checkpoint's weights")
    if not os.path.isfile(meta_file):  # a partial copy: the model's class, init arguments and step are in meta.pt
        raise FileNotFoundError(f"{path}: a sharded checkpoint folder without {LIGHTNING_META} (the run's model "
                                "class, hyper-parameters and step): not a complete checkpoint (a copy without it?)")
    scalars = set(checkpoint.get(SCALAR_KEYS) or ())
    checkpoint["state_dict"] = {k: v.reshape(()) if k in scalars and v.numel() == 1 else v
                                for k, v in nested["state_dict"].items()}
    # An FSDP2 run's EMA (mmssl.callbacks.EMA): the folder holds the raw weights as state_dict and
    # the average as AVERAGED_WEIGHTS; consolidated, it takes WeightAveraging's layout of a file.
    averaged = nested.get(AVERAGED_WEIGHTS)
    if isinstance(averaged, dict):
        checkpoint[RAW_WEIGHTS] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k: v.reshape(()) if k in scalars and v.numel() == 1 else v
                                    for k, v in averaged.items()}
    optimizers = sorted((k for k in nested if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_numbered_optimizer_state(nested[k], scalars) for k in optimizers]
    return checkpoint


def _numbered_optimizer_state(state: dict[str, Any], scalars: set = frozenset()) -> dict[str, Any]:
    """DCP's optimizer state (keyed by parameter name) in ``Optimizer.state_dict()``'s layout;
    the per-parameter tensors of ``scalars`` (parameter names) 0-d, as those parameters are."""
    index: dict[str, int] = {}
    groups = []
    for group in state.get("param_groups", []):
        names = group["params"]
        index.update({name: len(index) + i for i, name in enumerate(names)})
        groups.append({**group, "params": [index[name] for name in names]})
    def shaped(name: str, entry: Any) -> Any:
        if name not in scalars or not isinstance(entry, dict):
            return entry
        return {k: v.reshape(()) if isinstance(v, torch.Tensor) and v.shape == (1,) else v for k, v in entry.items()}

    return {"state": {index[name]: shaped(name, value) for name, value in state.get("state", {}).items()
                      if name in index}, "param_groups": groups}


def read_checkpoint(path: str, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint file as plain data: tensors, dicts, lists, numbers, strings.

    Args:
        path: a ``.safetensors`` file, or a ``torch.save`` file (``.ckpt``, ``.pth``, ``.pt``,
            ``.bin``) such as a Lightning checkpoint or a bare state dict.
        mmap: map a zip-format file's tensors instead of reading them (cheap look-ups of one
            entry, e.g. ``global_step``, in a large checkpoint).

    Returns:
        The file's top-level dict (a Lightning checkpoint, or a state dict).

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeCheckpointError: the file pickles a global outside torch's weights-only set and
            :data:`SAFE_GLOBALS` (nothing in it has been executed).

    A sharded checkpoint folder (DCP, an FSDP2 run's) is read whole by :func:`read_dcp_folder`.
    """
    if is_dcp_folder(path):
        return read_dcp_folder(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    # Only zip-format files can be mapped (torch.save's default); a legacy pickle is read whole.
    mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            state = torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError:
        names = _offending_globals(path)
        what = ", ".join(names) if names else "content torch's weights-only unpickler does not accept"
        raise UnsafeCheckpointError(
            f"{path}: refused to load: the file pickles {what}, which mmssl does not allow "
            "(checkpoints are read with torch.load(weights_only=True); only tensors, containers "
            "and primitives are accepted, as mmssl fit writes them). If the file is yours, re-save "
            "its state dict alone, or as .safetensors."
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a dict (checkpoint or state dict), found {type(state).__name__}")
    return state


# Lightning's WeightAveraging (mmssl.callbacks.EMA) writes the averaged weights to "state_dict",
# the raw ones to RAW_WEIGHTS and the AveragedModel's count to AVERAGING_STATE.
RAW_WEIGHTS, AVERAGING_STATE = "current_model_state", "averaging_state"
# The entry of a sharded checkpoint folder (an FSDP2 run's) holding the EMA's averaged weights.
AVERAGED_WEIGHTS = "averaged_state_dict"


def has_averaged_weights(checkpoint: dict[str, Any]) -> bool:
    """Whether a Lightning checkpoint was written with a weight average (``mmssl.callbacks.EMA``)."""
    return isinstance(checkpoint.get(RAW_WEIGHTS), dict) and AVERAGING_STATE in checkpoint


def lightning_weights(path: str, checkpoint: dict[str, Any], ema: bool = False) -> dict[str, torch.Tensor]:
    """The raw weights of a Lightning checkpoint, or with ``ema`` its averaged ones.

    Args:
        path: the file, named in errors.
        checkpoint: its contents, with a ``state_dict``.
        ema: the EMA's weights (its ``state_dict``) instead of the raw ones (``current_model_state``
            in a checkpoint with an average, else ``state_dict``).

    Raises:
        ValueError: ``ema`` asked of a checkpoint written without an average.
    """
    if has_averaged_weights(checkpoint):
        return checkpoint["state_dict"] if ema else checkpoint[RAW_WEIGHTS]
    if ema:
        raise CheckpointError(f"{path}: --ema asks for averaged weights and this checkpoint holds none (no "
                              f"'{RAW_WEIGHTS}'): it was not trained with mmssl.callbacks.EMA")
    return checkpoint["state_dict"]


def read_state_dict(path: str, ema: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file, unwrapped and with DDP's ``module.`` prefix removed.

    Args:
        path: see :func:`read_checkpoint`; a Lightning checkpoint (``"state_dict"``; its raw
            weights when it holds an EMA too, see :func:`lightning_weights`), an MAE release
            (``"model"``) or a bare state dict.
        ema: a Lightning checkpoint's averaged weights (refused for a file without them).

    Returns:
        The state dict, keys otherwise as stored.
    """
    state: dict[str, Any] = read_checkpoint(path)
    if isinstance(state.get("state_dict"), dict):
        return strip_ddp(lightning_weights(path, state, ema))
    if ema:
        raise CheckpointError(f"{path}: --ema reads a Lightning checkpoint's averaged weights; this file is no "
                              "Lightning checkpoint (no 'state_dict')")
    if isinstance(state.get("model"), dict):  # an MAE release (main_pretrain.py's save_model)
        state = state["model"]
    return strip_ddp(state)
