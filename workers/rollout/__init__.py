"""Rollout nodes: the Ray actor (``node``) over its sample scheduler, lease book, weight sync,
breaker and upkeep, and the inference engines it hosts (``engines``). One episode is played
by ``rollcall.workers.episode``."""
