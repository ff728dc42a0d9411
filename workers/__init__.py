"""Rollout nodes (engines, agent loops) and trainer ranks, as Ray actors.

Workers reach the database only through ``orchestrator.db`` repositories.
"""
