"""mmssl: self-supervised vision and vision-language pretraining on Lightning."""

__version__ = "0.1.0"
