"""pagedserve's OpenAI-compatible HTTP server: ``build_app`` for the app, ``pagedserve serve`` for the CLI."""
