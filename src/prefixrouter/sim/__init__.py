"""Discrete-event model of an inference cluster: engine model, KV cache, profiles."""
