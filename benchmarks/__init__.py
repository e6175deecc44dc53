"""Benchmarks: a load generator for OpenAI-compatible servers, a roofline probe and baselines."""
