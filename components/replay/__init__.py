"""Replay: circular transition storage (memory or disk), frame-deduplicating Atari
storage, sum trees, a thread-safe uniform/prioritized buffer and n-step returns.

Import the modules you need (``components.replay.buffer`` etc.); this file stays
empty so that ``import components.replay`` costs nothing.
"""
