"""Apogee schedule service: delivers delayed and timer messages when they are due."""
