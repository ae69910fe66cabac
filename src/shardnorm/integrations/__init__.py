"""Thin adapters that put shardnorm into other frameworks' training stacks (optional extras)."""
