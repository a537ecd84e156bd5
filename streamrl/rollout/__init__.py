"""Rollout side: inference engines behind SGLang's HTTP API, the router, workers."""
