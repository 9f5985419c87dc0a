"""What runs under a StreamingSession and a BatchEngine: the prompt prefill (timeline, prefill track,
prompt cache), the frame step over every row and its compiled form (docs/engine.md)."""
