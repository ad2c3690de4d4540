"""The REST API under ``/api/v1``: thin routes over :mod:`apogee_console.core`."""
