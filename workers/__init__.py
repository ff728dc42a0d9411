"""Rollout nodes (engines, their episodes) and trainer ranks, as Ray actors.

Workers reach the database only through ``rollcall.orchestrator.db`` repositories.
"""
