"""The raw JSON body: bounds, parsing, and the worker process that parses large bodies."""
