"""fsdp2gen: scaffold PyTorch FSDP2 training projects from a copier template."""

__version__ = "0.2.0"
