"""The OpenAI-compatible HTTP server of a runtime pod (routes, errors, auth, metrics).

Import :func:`splitserve_runtime.server.app.build_app` or run `splitserve serve`. This
package imports no torch by itself; the engine is built lazily by `app.main`.
"""
