"""tensorfleet: distributed training of PyTorch models in the style of Distributed TensorFlow."""

__version__ = "0.1.0"
