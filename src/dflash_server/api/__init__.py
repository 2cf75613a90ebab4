"""HTTP layer: OpenAI request/response shapes, error objects, routes and the app factory."""
