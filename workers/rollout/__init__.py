"""Rollout nodes: the agent loop, tool execution and inference engines."""
