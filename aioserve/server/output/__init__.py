"""The output side: generation, content processing, response bodies, SSE."""
