"""Capacity planning: pure arithmetic over model specs, no torch."""
