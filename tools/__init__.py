"""mmssl's tools: each ``tools/X.py`` is ``mmssl X`` (``mmssl --help`` lists them), ``python -m
mmssl.tools.X`` and, in a clone, ``python tools/X.py``. The wheel ships this folder as ``mmssl.tools``."""
