"""`atomflow serve`: an OpenAI-compatible HTTP server over the single-stream Engine.

app.py (routes) -> worker.py (one engine thread, bounded FIFO) -> atomflow.Engine; protocol.py
holds the request models and the error object, metrics.py the Prometheus metrics, static/ the
chat page. Importing this package pulls in nothing heavy: fastapi and uvicorn load in app.py.
"""
