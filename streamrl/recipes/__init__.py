"""Recipes: code that prepares a run before ``streamrl up`` starts its parts (data, a model, a warm start).

A recipe is ``fn(cfg, **args) -> dict`` of dotted config overrides (e.g. ``model.path``), named in the
config as ``prepare.fn: module:function``. It must be idempotent: a second call reuses what it made.
"""
