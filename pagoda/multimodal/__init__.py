"""Multimodal inputs (images): what a request carries, how it is hashed, processed, scheduled and
encoded. The model-specific parts (vision towers, placeholder counts) live with the models."""
