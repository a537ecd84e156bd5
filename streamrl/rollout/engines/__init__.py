"""Inference engines. Each turns token ids into sampled token ids with behaviour logprobs."""
