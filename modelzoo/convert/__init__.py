"""Readers and converters for foreign checkpoints (MXNet .params, GluonCV, Hugging Face)."""
