"""A line a `specdecode bench` or `loadtest` report opens with: huge pages for ours and for the peers started (the
CPU's line is host.cpu_description)."""

from __future__ import annotations


def hugepages_status() -> str:
    """Huge pages for ours and for the peers started (peers get the user's environment: hugepages.user_env)."""
    from ..host.hugepages import status

    return status() + "; peers started as a user starts them"
