"""Data: the image-text data module and its stream (sources, plan, reading, decode, transforms),
image folders, labelled sets, shard writing and the demo data. Imports no model or loss."""
