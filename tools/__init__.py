"""Offline tools: fetching packs, ranking a draft vocabulary, training acceptance heads, and the
prompt sets the benchmarks and tools read (``tools.prompts``)."""
