"""The load generator behind ``pagedserve bench serve``: synthetic prompts, an OpenAI streaming client at a
set concurrency or request rate, TTFT/TPOT/ITL metrics, and an optional plot. It ships in the wheel; the
research benchmarks that drive it (``make bench``) stay in the repository's ``benchmarks/``."""
