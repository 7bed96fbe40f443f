"""The control plane's errors, each with the HTTP status the REST API answers with."""
from __future__ import annotations


class JobError(Exception):
    status = 400

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class NotFound(JobError):
    status = 404


class Conflict(JobError):
    status = 409


class Invalid(JobError):
    status = 422


class TooMany(JobError):
    status = 429


class StorageTrouble(JobError):
    status = 503
