"""Request intake: reading the body, the request models, their limits."""
