"""Environments: the Env protocol, the registry, and built-in tasks."""

from streamrl.envs.base import Action, Env, Message, Observation, StepResult
from streamrl.envs.registry import available, env_class, env_factory

__all__ = ["Action", "Env", "Message", "Observation", "StepResult", "available", "env_class", "env_factory"]
