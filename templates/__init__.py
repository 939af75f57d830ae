"""Conversation templates and the training-overrides template, installed as neva_pack.yaml_templates."""
