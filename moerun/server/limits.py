"""Request limits the server package and its app share."""

DEFAULT_MAX_BODY = 4 * 2**20  # bytes: a larger request body is answered 413
