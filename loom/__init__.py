"""Loom: PyTorch-native parallel training of transformer language models."""
