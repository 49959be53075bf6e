"""Pictures of what an encoder learned: attention maps, patch-text similarity, scaling fits.

Pure functions over models and tensors (``attention``, ``similarity``, ``scaling``) and their
matplotlib figures (``figures``); ``tools/attention_maps.py``, ``tools/similarity_map.py`` and
``tools/scaling_fit.py`` are thin command lines over them.
"""
