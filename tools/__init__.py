"""Offline tools: fetching packs, ranking a draft vocabulary, training acceptance heads."""
