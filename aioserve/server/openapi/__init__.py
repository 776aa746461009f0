"""The OpenAPI document, its operations and schemas, and Swagger UI."""
