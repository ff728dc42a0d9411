"""Alembic environment and revisions of rollcall's schema (run by ``rollcall db upgrade``)."""
