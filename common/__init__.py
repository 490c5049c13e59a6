"""Shared code of the eagle3-train stages: config, manifests, logging, data, models."""
