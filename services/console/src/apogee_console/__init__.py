"""Apogee console: a web console and a REST API (FastAPI, served by uvicorn) over the admin SDK.

``python -m apogee_console`` runs it; :func:`apogee_console.app.create_app` builds the app
(tests drive it in-process). docs/console.md describes the API, the settings and access.
"""
