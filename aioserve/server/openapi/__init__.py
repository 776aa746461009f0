"""The OpenAPI 3.1 document of the route table (GET /openapi.json), and the
Swagger UI page that reads it (GET /docs).

  endpoint.py     one endpoint as plain data: path, method, handler, its OpenAPI operation
  document.py     the document: the route table's paths and the schemas
  operations.py   the operation objects: what each kind of endpoint takes and answers
  schemas.py      the schemas, generated from the request models and response bodies the handlers use
  docs_routes.py  GET /docs: Swagger UI from the swagger-ui-bundle package's files
"""
