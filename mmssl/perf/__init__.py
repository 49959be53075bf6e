"""Throughput measurement: step timing, FLOP counting, device peaks and the open_clip_train peer."""
