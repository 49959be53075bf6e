"""``python -m mmssl ...`` is ``mmssl ...`` (for torchrun: ``torchrun ... -m mmssl fit ...``)."""

from mmssl.cli import main

main()
