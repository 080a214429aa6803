"""rtp.engine: runner, sampler, loader, tokenizer and the engine loop (see DESIGN.md)."""
