"""Adapters from training frameworks to shardnorm's public API, one small module per framework (DeepSpeed's
split into its config, conversion and AutoTP parts); see docs/architecture.md."""
