"""Under mutmut only: a mutated LightningModule ``__init__`` keeps its hyper-parameters.

Lightning's ``save_hyperparameters`` collects each constructor's arguments from the frames named
``__init__`` (``lightning.pytorch.utilities.parsing._get_init_args``); mutmut runs a mutated
``__init__`` (and the original, behind its trampoline) under the name ``xǁClsǁ__init____mutmut_<n>``,
so a mutated ``CoCa`` lost ``caption_loss_weight`` and every other argument of its own from
``hparams``, and every test failed before a mutant was applied (docs/mutation.md). Frames of that
name are read as ``__init__`` frames; every other frame goes to Lightning's own function, so the
ordinary suite runs Lightning unchanged.
"""

from __future__ import annotations

import inspect
import re

import lightning.pytorch.utilities.parsing as parsing

_MUTMUT_INIT = re.compile(r"ǁ__init____mutmut_\w+$")
_lightning_get_init_args = parsing._get_init_args


def _get_init_args(frame):
    if not _MUTMUT_INIT.search(frame.f_code.co_name):
        return _lightning_get_init_args(frame)
    local_vars = inspect.getargvalues(frame)[3]
    if "__class__" not in local_vars:
        return None, {}
    cls = local_vars["__class__"]
    self_var, args_var, kwargs_var = parsing.parse_class_init_keys(cls)
    excluded = (*[n for n in (self_var, args_var, kwargs_var) if n], "__class__", "frame", "frame_args")
    local_args = {k: local_vars[k] for k in inspect.signature(cls.__init__).parameters}
    if kwargs_var:
        local_args.update(local_args.get(kwargs_var, {}))
    return local_vars.get(self_var), {k: v for k, v in local_args.items() if k not in excluded}


parsing._get_init_args = _get_init_args
