"""One typed configuration tree for every streamrl process.

Every process (router, servers, rollout workers, learner) reads the same YAML file; command-line overrides use
dotted paths: ``learner.lr=3e-6``. ``sections`` holds the tree (a module per part), ``rules`` the combinations
refused, ``load`` reading and overriding, ``reference`` the generated reference page.
"""

from streamrl.config import rules  # noqa: F401  (each rule adds itself to the tree's checks as it is defined)
from streamrl.config.load import ConfigError, config_from, dump_config, load_config
from streamrl.config.sections import (
    Config,
    EvalConfig,
    LearnerConfig,
    ModelConfig,
    OffPolicyConfig,
    PrepareConfig,
    RayConfig,
    RedisConfig,
    RewardConfig,
    RolloutConfig,
    RouterConfig,
    RunConfig,
    SamplingConfig,
    Section,
    ServerConfig,
    SuperviseConfig,
    WeightSyncConfig,
)

__all__ = ["Config", "ConfigError", "config_from", "EvalConfig", "LearnerConfig", "ModelConfig", "OffPolicyConfig", "PrepareConfig",
           "RayConfig", "RedisConfig", "RewardConfig", "RolloutConfig", "RouterConfig", "RunConfig", "SamplingConfig",
           "Section", "ServerConfig", "SuperviseConfig", "WeightSyncConfig", "dump_config", "load_config"]
