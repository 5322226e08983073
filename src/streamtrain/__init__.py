"""streamtrain: continuous PyTorch training from a Kafka stream of sensor events."""

__version__ = "0.1.0"
