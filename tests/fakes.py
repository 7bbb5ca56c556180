"""Fakes that are real implementations of vitserve's interfaces, for tests where a real part cannot run."""
