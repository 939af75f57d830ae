"""neva_pack: sequence-packing preprocessing for multimodal (NeVA / LLaVA) fine-tuning."""

__version__ = "0.1.0"
