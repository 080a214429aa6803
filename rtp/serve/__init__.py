"""The OpenAI-compatible server: `rtp serve` (see server.py for the process, openai_api.py for the routes)."""
