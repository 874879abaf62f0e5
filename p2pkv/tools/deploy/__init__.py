"""Launching engines: ``vllm serve`` command lines, child processes, health waits."""
