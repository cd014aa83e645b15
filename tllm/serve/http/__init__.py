"""The HTTP side every route shares: the FastAPI app, errors, limits, auth, CORS, request ids, metrics, the dashboard, the engine supervisor and the server."""
