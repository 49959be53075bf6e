"""``python -m mmssl ...`` is ``mmssl ...`` (for torchrun: ``torchrun ... -m mmssl fit ...``)."""

from mmssl.entry import main

main()
