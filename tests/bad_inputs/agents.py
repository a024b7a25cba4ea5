"""Agents for the bad-input corpus: each breaks the agent contract `agent(row, base_url, api_key)` one way."""

from __future__ import annotations


def one_arg(row):
    """Takes the row but neither the base URL nor the key."""
    return 0.0
