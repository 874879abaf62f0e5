"""Helpers for tests that need a valid AgentInfo for a real NIXL agent."""

from __future__ import annotations

from p2pkv.doctor import loopback_info as agent_info_for

__all__ = ["agent_info_for"]
