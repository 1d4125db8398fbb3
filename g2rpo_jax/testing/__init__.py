"""Reference checkpoints and oracles for tests and benchmarks (need the `[test]` extra)."""
