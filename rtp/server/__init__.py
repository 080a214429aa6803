"""The worker process, `rtp serve`: the OpenAI API over the engine (see server.py for the process,
openai_api.py for the routes, async_engine.py for the one holder of the engine, pd/ for
prefill/decode disaggregation)."""
