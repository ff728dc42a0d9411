"""Repositories: all SQL of the control plane. Each takes a session and never commits."""
