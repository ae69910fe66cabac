"""Thin adapters that bring shardnorm into the trainers people run (torchtitan, Lightning, ...)."""
