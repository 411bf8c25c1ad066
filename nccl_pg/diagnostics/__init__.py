"""Diagnostics: the flight recorder, dumps, progress and timeout diagnosis, and the dump analyzer."""
